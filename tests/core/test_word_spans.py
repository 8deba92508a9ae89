"""Word spans (``words=1`` of ``snapkv`` and ``kvzip``, ``core/words.py``): every token of a word
ranks at least at the word's best unpooled score (kvzip: past its pass only); the cache records each row's ids by ordinal through every
path that reads a prompt (one call, streamed pieces, the reconstruction pass), never a probe's."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.reconstruction import rank_by_probes
from h2okv.core.words import MAX_WORD_TOKENS, TIE_BREAK, WordRecord, span_max, word_edges, word_numbers
from h2okv.tools.tiny import random_ids, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:h2okv. a budget of")


class SpacedTokenizer:
    """A byte-level-BPE-like vocabulary: the ids divisible by 3 begin with a space mark (a word is
    one of them and the ids after it that are not); ids 0 and 1 are special."""

    all_special_ids = [0, 1]

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def convert_ids_to_tokens(self, ids):
        return [f"\u0120w{i}" if i % 3 == 0 else f"w{i}" for i in ids]


def edges(size=30):
    return word_edges(SpacedTokenizer(size))


def test_words_start_at_whitespace_and_after_it():
    begins, ends = edges()
    assert begins[3] and not begins[4] and begins[0] and ends[0]  # special ids stand alone
    ids = torch.tensor([[5, 3, 4, 7, 6, 1, 8, -1, 4]])
    #                    w5 |_w3 w4 w7 |_w6 |<s>| w8 | ? | w4
    assert word_numbers(ids, begins, ends).tolist() == [[0, 1, 1, 1, 2, 3, 4, -1, 6]]  # numbers: distinct, not dense


def test_a_run_without_whitespace_is_cut_every_max_word_tokens():
    begins, ends = edges()
    ids = torch.full((1, 2 * MAX_WORD_TOKENS + 1), 4)  # one long run of "w4"
    numbers = word_numbers(ids, begins, ends)[0]
    assert numbers[:MAX_WORD_TOKENS].eq(0).all() and numbers[MAX_WORD_TOKENS:2 * MAX_WORD_TOKENS].eq(1).all()
    assert int(numbers[-1]) == 2


def test_a_vocabulary_without_whitespace_marks_makes_each_token_a_word():
    from h2okv.tools.tiny import word_tokenizer

    begins, ends = word_edges(word_tokenizer())  # "w5", "w6", ...: its pre-tokenizer drops the spaces
    assert word_numbers(torch.tensor([[5, 6, 7]]), begins, ends).tolist() == [[0, 1, 2]]


def test_a_tokenizer_with_decode_only_is_read_id_by_id():
    class Decoding:  # one character an id, no convert_ids_to_tokens, no len()
        def decode(self, ids):
            return "".join(" " if i == 2 else chr(ord("a") + i) for i in ids)

    begins, ends = word_edges(Decoding(), size=8)
    assert word_numbers(torch.tensor([[3, 4, 2, 5, 6]]), begins, ends).tolist() == [[0, 0, 1, 2, 2]]


def test_a_tokenizer_with_no_vocabulary_to_read_warns_and_pools_as_without_words():
    class Opaque:
        def __call__(self, text):
            return {"input_ids": [3 for _ in text]}

    assert word_edges(Opaque(), size=8) is None
    model, ids, _ = model_and_ids(n=200, batch=1)
    plain = read_prompt(model, ids, None, "snapkv:kernel=1,pool=max", budget=400, prefill="late")
    with pytest.warns(UserWarning, match="cannot read the tokenizer's vocabulary"):
        spanned = read_prompt(model, ids, Opaque(), "snapkv:kernel=1,pool=max,words=1", budget=400, prefill="late")
    for mine, theirs in zip(plain.layers, spanned.layers, strict=True):
        assert torch.equal(mine.score, theirs.score)


def test_ids_past_the_vocabulary_stand_alone():
    begins, ends = edges(size=10)
    assert word_numbers(torch.tensor([[4, 11, 4]]), begins, ends).tolist() == [[0, 1, 2]]


def test_span_max_raises_each_live_slot_to_its_words_best_raw_score():
    raw = torch.tensor([[[1.0, 5.0, 2.0, 3.0, 9.0, 4.0, 1.0]]])
    pooled = torch.tensor([[[1.0, 5.0, 2.5, 4.0, 9.0, 4.0, 6.0]]])
    words = torch.tensor([[[0, 0, 1, 1, 1, -1, 2]]])
    valid = torch.tensor([[[True, True, True, True, False, True, True]]])
    out = span_max(pooled, raw, words, valid)[0, 0]
    # token 0 raised to its word's best (5) with its own raw as the tie-break; token 2 to 3 (the free
    # slot's 9 is nobody's); token 3 already pooled above its word's best; a token of no known word
    # and a word of one token stay as pooled
    expected = torch.tensor([5.0 + TIE_BREAK * 1.0, 5.0, 3.0 + TIE_BREAK * 2.0, 4.0, 9.0, 4.0, 6.0])
    torch.testing.assert_close(out, expected)


def test_span_max_keeps_heads_and_rows_apart():
    raw = torch.arange(8.0).view(2, 2, 2)
    out = span_max(raw, raw, torch.zeros(2, 2, 2, dtype=torch.long), torch.ones(2, 2, 2, dtype=torch.bool))
    torch.testing.assert_close(out[..., 0], raw[..., 1] + TIE_BREAK * raw[..., 0])
    torch.testing.assert_close(out[..., 1], raw[..., 1])


def model_and_ids(n=300, batch=2):
    model = tiny_model("qwen2", max_position_embeddings=1024)
    return model, random_ids(n, batch=batch, seed=1), SpacedTokenizer(model.config.vocab_size)


def generate(model, ids, max_new_tokens, cache):
    """``model.generate`` greedy with ``cache`` (drop-in: the streamed prefill runs from its hook)."""
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=1)
    return out[:, ids.shape[1]:]


def read_prompt(model, ids, tokenizer, policy, **keywords):
    cache = H2OCache(model, policy=policy, tokenizer=tokenizer, chunk_size=64, **keywords)
    with torch.inference_mode():
        model(input_ids=ids, **cache_arg(cache), use_cache=True)
    return cache


@pytest.mark.parametrize("prefill", ["late", "chunked"])
def test_a_prompts_scores_are_raised_to_their_words_best(prefill):
    """Nothing evicted and no pool (kernel 1): the word-spanned cache holds exactly the plain scores,
    each raised to the best of its word (the same tokens are read either way)."""
    model, ids, tok = model_and_ids()
    plain = read_prompt(model, ids, tok, "snapkv:kernel=1,pool=max", budget=400, prefill=prefill)
    spanned = read_prompt(model, ids, tok, "snapkv:kernel=1,pool=max,words=1", budget=400, prefill=prefill)
    record = spanned.row_budgets.words
    assert torch.equal(record.ids[:, :ids.shape[1]], ids)
    for mine, theirs in zip(plain.layers, spanned.layers, strict=True):
        expected = span_max(mine.score, mine.score, record.of(mine.ordinal), mine.valid)
        torch.testing.assert_close(theirs.score, expected)
        assert not torch.equal(theirs.score, mine.score)


@pytest.mark.parametrize("prefill", ["late", "chunked", "streamed"])
def test_words_the_kernel_reaches_across_rank_as_without_spans(prefill):
    """A pool of 5 (2 either side) reaches across every word of one to three tokens: word spans
    change no score, so what is kept and the tokens generated are the plain policy's."""
    model, ids, tok = model_and_ids(n=400)
    ids[:, ::3] = ids[:, ::3] // 3 * 3  # a word starts at least every third token
    caches = [H2OCache(model, policy=f"snapkv:kernel=5,pool=max,words={w}", budget=50, prefill=prefill,
                       chunk_size=64, tokenizer=tok) for w in (0, 1)]
    out = [generate(model, ids, 4, cache) for cache in caches]
    assert torch.equal(out[0], out[1])
    for mine, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(mine.score, theirs.score) and torch.equal(mine.ordinal, theirs.ordinal)


def test_nothing_evicted_equals_a_plain_run():
    model, ids, tok = model_and_ids()
    out = []
    for words in (0, 1):
        cache = H2OCache(model, policy=f"snapkv:kernel=5,pool=max,words={words}", budget=400, prefill="streamed",
                         chunk_size=64, tokenizer=tok)
        out.append(generate(model, ids, max_new_tokens=4, cache=cache))
    assert torch.equal(out[0], out[1])


def test_streamed_pieces_are_recorded_and_the_probes_write_nothing():
    model, ids, tok = model_and_ids(n=500)
    cache = H2OCache(model, policy="snapkv:kernel=5,pool=max,words=1", budget=60, prefill="streamed", chunk_size=64,
                     tokenizer=tok)
    generate(model, ids, max_new_tokens=3, cache=cache)
    record = cache.row_budgets.words
    assert torch.equal(record.ids[:, :ids.shape[1]], ids)
    assert bool((record.ids[:, ids.shape[1]:] == -1).all())  # the probes' and decode steps' ids: none
    for layer in cache.layers:
        assert int(layer.valid.sum(-1).max()) <= 60 + 1


def test_a_row_alone_keeps_what_it_keeps_in_a_batch():
    model, ids, tok = model_and_ids(n=400)
    policy = "snapkv:kernel=5,pool=max,words=1"
    both = H2OCache(model, policy=policy, budget=50, prefill="streamed", chunk_size=64, tokenizer=tok)
    batch = generate(model, ids, max_new_tokens=4, cache=both)
    for row in range(2):
        alone = H2OCache(model, policy=policy, budget=50, prefill="streamed", chunk_size=64, tokenizer=tok)
        assert torch.equal(generate(model, ids[row:row + 1], max_new_tokens=4, cache=alone)[0], batch[row])


def kvzip_ranked(model, ids, tok, policy, probe):
    """Read ``ids`` under ``policy`` (late, nothing evicted), then rank it by the pass over ``probe``."""
    cache = read_prompt(model, ids, tok, policy, budget=400, prefill="late")
    with torch.inference_mode():
        rank_by_probes(model, cache, [probe])
    return cache


def test_the_reconstruction_pass_is_never_spanned():
    """kvzip: where the pass ranks (a prompt within probe_upto), words=1 scores every slot exactly as
    without it, and its probe calls leave no ids behind."""
    model, ids, tok = model_and_ids(n=120, batch=1)
    probe = random_ids(40, batch=1, seed=2)
    plain, spanned = (kvzip_ranked(model, ids, tok, f"kvzip:question=4,probe_upto=200{words}", probe)
                      for words in ("", ",words=1"))
    record = spanned.row_budgets.words
    assert torch.equal(record.ids[:, :120], ids) and bool((record.ids[:, 120:] == -1).all())
    numbers = record.of(plain.layers[0].ordinal)
    assert not torch.equal(span_max(plain.layers[0].score, plain.layers[0].score, numbers, plain.layers[0].valid),
                           plain.layers[0].score)  # spans would have changed these scores
    for mine, theirs in zip(plain.layers, spanned.layers, strict=True):
        assert torch.equal(theirs.score, mine.score)


def test_past_probe_upto_the_questions_attention_takes_word_spans():
    """kvzip (question_kernel 1): a prompt past probe_upto is ranked by its question's attention alone,
    each slot raised to its word's best."""
    model, ids, tok = model_and_ids(n=120, batch=1)
    probe = random_ids(40, batch=1, seed=2)
    plain, spanned = (kvzip_ranked(model, ids, tok, f"kvzip:question=4,probe_upto=16{words}", probe)
                      for words in ("", ",words=1"))
    record = spanned.row_budgets.words
    changed = 0
    for mine, theirs in zip(plain.layers, spanned.layers, strict=True):
        expected = span_max(mine.score, mine.score, record.of(mine.ordinal), mine.valid)
        torch.testing.assert_close(theirs.score, expected)
        changed += int(not torch.equal(expected, mine.score))
    assert changed == len(plain.layers)


def test_kvzip_words_without_a_question_past_probe_upto_is_refused():
    from h2okv.errors import H2OError
    from h2okv.policies import make_policy

    for spec in ("kvzip:words=1", "kvzip:question=32,words=1"):
        with pytest.raises(H2OError, match="words spans the question's attention past probe_upto"):
            make_policy(spec)


def test_rows_taken_and_appended_keep_their_ids():
    model, ids, tok = model_and_ids(n=200, batch=2)
    cache = read_prompt(model, ids, tok, "snapkv:kernel=5,pool=max,words=1", budget=40, prefill="chunked")
    second = cache.take_rows([1])
    assert torch.equal(second.row_budgets.words.ids[:, :200], ids[1:])
    first = cache.take_rows([0])
    first.append_rows(second)
    assert torch.equal(first.row_budgets.words.ids[:, :200], ids)


def test_rows_added_before_any_write_line_up():
    record = WordRecord()
    record.extend(3, None, 2)  # three rows never written, two new ones
    assert record.rows == 5
    record.write(torch.tensor([[4, 5]] * 5), None, torch.zeros(5, dtype=torch.long))
    assert record.ids.shape[0] == 5


def test_without_a_tokenizer_it_warns_once_and_pools_as_without_words(tmp_path):
    model, ids, _ = model_and_ids(n=200, batch=1)
    model.name_or_path = str(tmp_path)  # a folder with no tokenizer
    plain = read_prompt(model, ids, None, "snapkv:kernel=5,pool=max", budget=400, prefill="late")
    with pytest.warns(UserWarning, match="pools by words and found no tokenizer"):
        spanned = read_prompt(model, ids, None, "snapkv:kernel=5,pool=max,words=1", budget=400, prefill="late")
    for mine, theirs in zip(plain.layers, spanned.layers, strict=True):
        assert torch.equal(mine.score, theirs.score)
