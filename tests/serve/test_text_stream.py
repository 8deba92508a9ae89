"""Incremental detokenisation (``TextStream``): the text sent for a generation is exactly
``decode(all ids)`` cut at the first stop string, and a step decodes only the tail, so decoding a
generation costs O(n) ids, not O(n^2)."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.text import TextStream
from h2okv.tools.tiny_chat import tiny_tokenizer
from serve_cases import CHUNK, prompt

TOK = tiny_tokenizer()  # byte-level: a multi-byte character spans several tokens
WORDS = ["中文", "😀", "🧑‍🚀", "é", "END", "ab", " ", "\n\n", "文😀", "ok"]
STOPS = ["END", "😀", "文😀", "\n\n", "b é", "k中"]


def decode(ids):  # as the engine decodes
    return TOK.decode(ids, skip_special_tokens=True)


def encode(text):
    return TOK.encode(text, add_special_tokens=False)


def expected(ids, stops):
    """What the text was before incremental decoding: each step decoded all ids, and the first
    step whose text holds a stop ended the generation there."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)], True
    return decode(ids), False


def stream(ids, stops, decoder=decode):
    """The pieces sent for ``ids`` and whether a stop ended them (``Output.emit``'s use)."""
    text = TextStream(decoder, stops)
    pieces = []
    for token in ids:
        piece, stopped = text.push(token)
        pieces.append(piece)
        if stopped:
            assert text.flush() == ""
            return pieces, True
    return pieces + [text.flush()], False


# random ids (any byte, a special token, which decode skips: an ignore_eos generation feeds EOS on)
# mixed with whole words, so stops and multi-byte characters occur, whole or cut
chunks = st.one_of(st.integers(0, len(TOK) - 1).map(lambda i: [i]), st.sampled_from([encode(w) for w in WORDS]))
id_lists = st.lists(chunks, max_size=40).map(lambda parts: [i for part in parts for i in part])


@settings(max_examples=300, deadline=None)
@given(ids=id_lists, stops=st.lists(st.sampled_from(STOPS), max_size=3, unique=True))
def test_the_pieces_are_the_whole_decode_cut_at_the_first_stop(ids, stops):
    pieces, stopped = stream(ids, stops)
    text, stops_here = expected(ids, stops)
    assert ("".join(pieces), stopped) == (text, stops_here)


@settings(max_examples=300, deadline=None)
@given(ids=id_lists)
def test_push_plain_sends_what_push_sends_without_stops(ids):
    """A plain request's handle pushes with ``push_plain``: the pieces ``push`` gives a stream
    without stop strings, one by one, and the same flush."""
    plain, general = TextStream(decode, []), TextStream(decode, [])
    for token in ids:
        assert plain.push_plain(token) == general.push(token)[0]
    assert plain.flush() == general.flush()


def test_text_that_could_start_a_stop_waits():
    ids = encode("ab 中文")
    pieces, stopped = stream(ids, ["b é", "文😀"])
    # "b" and "b " could start "b é": held until 中 (three bytes, sent whole) rules it out; "文"
    # could start "文😀" until the generation ends (flush)
    assert pieces == ["a", "", "", "", "", "b 中", "", "", "", "文"] and not stopped


class Counting:
    def __init__(self):
        self.ids = 0

    def __call__(self, ids):
        self.ids += len(ids)
        return decode(ids)


def test_decoding_a_generation_costs_linear_ids():
    rng = random.Random(0)
    ids = []
    while len(ids) < 500:
        ids += encode(rng.choice(WORDS)) if rng.random() < 0.5 else [rng.randrange(len(TOK))]
    ids = ids[:500]
    counting = Counting()
    pieces, stopped = stream(ids, ["<never>"], counting)
    assert "".join(pieces) == decode(ids) and not stopped
    # decoding all ids each step passed n(n+1)/2 = 125,250 ids; the tail: a few per token
    assert counting.ids < 20 * len(ids)


def test_a_served_generation_decodes_linear_ids(model_tok):
    model, tok = model_tok
    eng = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK))
    counting = Counting()
    eng.detokenize = counting  # what each request's Output decodes with
    eng.start()
    try:
        req = GenerationRequest(prompt(20, 1), 500, "h2o", 8, 8, temperature=1.0, seed=3, ignore_eos=True)
        text, done = eng.submit(req).result_blocking()
    finally:
        eng.stop()
    assert len(done.token_ids) == 500 and text == decode(done.token_ids)
    assert counting.ids < 20 * 500
