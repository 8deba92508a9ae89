import json
import math

import pytest
import torch

import h2okv.models
from h2okv import H2OCache
from h2okv.cli import main
from h2okv.cli.args import parse_budgets, parse_policies
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.eval.ppl import after_fill, ppl_grid
from h2okv.eval.scoring import make_cache, perplexity, streaming_nll, token_nll
from h2okv.tools.tiny import VOCAB, random_ids, tiny_model


def test_perplexity_matches_hand_computation():
    # vocab 2, logits [0, ln 3] -> p = [1/4, 3/4]; vocab 3 row uniform -> p = 1/3
    logits = torch.tensor([[[0.0, math.log(3.0), -math.inf], [0.0, 0.0, 0.0], [5.0, 5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 2]])  # predictions: token 1 from row 0 (p=3/4), token 2 from row 1 (p=1/3)
    nll = token_nll(logits, ids)
    assert nll.shape == (1, 2)
    expected = [-math.log(0.75), -math.log(1 / 3)]
    assert nll[0].tolist() == pytest.approx(expected, rel=1e-6)
    assert perplexity(nll) == pytest.approx(math.exp(sum(expected) / 2), rel=1e-6)


# "random" too: each layer draws from its own seeded stream, so the order in which a forward
# interleaves layers does not change which slots it picks
@pytest.mark.parametrize("policy", ["h2o", "local", "sink", "random", "tova", "h2o-sink", "h2o-mean", "snapkv"])
def test_one_forward_with_chunk_1_equals_token_by_token_decode(llama, policy):
    """The streaming pass is exactly Algorithm 1: same logits as feeding one token at a time."""
    n, budget = 40, 0.3
    ids = random_ids(n, batch=2, seed=3)
    with torch.inference_mode():
        one = llama(ids, **cache_arg(make_cache(llama, policy, budget)), use_cache=True).logits
        # the same budget as absolute slots: ratios resolve against the first call, here 1 token
        half = int(budget / 2 * n)
        loop_cache = H2OCache(llama, policy=policy, heavy=half, recent=half)
        steps = [llama(ids[:, t : t + 1], **cache_arg(loop_cache), use_cache=True).logits for t in range(n)]
    loop = torch.cat(steps, dim=1)
    assert torch.allclose(one, loop, atol=1e-4), (one - loop).abs().max()
    assert max(loop_cache.stats()["slots"]) == 2 * half  # the loop really evicted


def test_eviction_shapes_the_scores(llama):
    ids = random_ids(64, batch=2, seed=1)
    full, slots_full = streaming_nll(llama, ids, "full", None)
    assert slots_full is None
    # a budget that holds the whole text never evicts: the same numbers as full
    whole, _ = streaming_nll(llama, ids, "h2o", 1.0)
    assert torch.allclose(whole, full, atol=1e-5)
    # a tiny budget: identical until the cache first evicts, different afterwards
    small, slots = streaming_nll(llama, ids, "h2o", 0.125)
    assert slots == 8
    assert torch.allclose(small[:, : slots + 1], full[:, : slots + 1], atol=1e-5)
    assert after_fill(small, slots).shape[1] == 64 - 1 - (slots + 1)
    assert (after_fill(small, slots) - after_fill(full, slots)).abs().max() > 1e-3
    assert abs(perplexity(small) - perplexity(full)) > 1e-4


def test_full_chunked_equals_full_per_token(llama):
    ids = random_ids(50, seed=2)
    with torch.inference_mode():
        chunked = llama(ids, **cache_arg(make_cache(llama, "full", None)), use_cache=True).logits
        per_token = llama(ids, **cache_arg(H2OCache(llama, policy="full", chunk_size=1)), use_cache=True).logits
    assert torch.allclose(chunked, per_token, atol=1e-4)


def test_grid_rows_and_ratios(llama):
    ids = random_ids(48, batch=2, seed=4)
    rows, full_ppl = ppl_grid(llama, ids, ["h2o", "local"], [0.25, 0.5], progress=False)
    assert [(r.policy, r.budget) for r in rows] == [("h2o", 0.25), ("h2o", 0.5), ("local", 0.25), ("local", 0.5)]
    assert full_ppl == pytest.approx(perplexity(streaming_nll(llama, ids, "full", None)[0]))
    for r in rows:
        assert r.tokens == 48 and r.segments == 2
        assert r.slots == int(r.budget / 2 * 48) * 2
        assert r.ppl_ratio_to_full == pytest.approx(r.ppl / full_ppl)
    rows_with_full, _ = ppl_grid(llama, ids, ["full", "h2o"], [0.25], progress=False)
    assert rows_with_full[0].policy == "full" and rows_with_full[0].ppl_ratio_to_full == 1.0


@pytest.mark.parametrize(
    "text, error",
    [("h2o,nope", "unknown policy 'nope'"), ("", "--policies is empty")],
)
def test_parse_policies_errors(text, error):
    with pytest.raises(H2OError, match=error):
        parse_policies(text)


@pytest.mark.parametrize("text, error", [("0.1,x", "not a number"), ("0", r"\(0, 1\]"), ("1.5", r"\(0, 1\]"), (",", "empty")])
def test_parse_budgets_errors(text, error):
    with pytest.raises(H2OError, match=error):
        parse_budgets(text)


def test_parse_budgets_sorted_unique():
    assert parse_budgets("0.5, 0.1,0.1") == [0.1, 0.5]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policies", "h2o,bogus"], "unknown policy 'bogus'"),
        (["--policies", "h2o,snapkv:window=0"], "snapkv window must be >= 1"),
        (["--policies", "snapkv:span=3"], "has no option 'span'"),
        (["--budgets", "2"], "budget 2 must be a fraction"),
        (["--text", "/nonexistent/file.txt"], "text file not found"),
        (["--corpus", "gutenberg:x"], "--corpus must look like shakespeare:NAME"),
        (["--corpus", "shakespeare:no_such_play"], "no play named 'no_such_play'"),
        (["--plot", "out.jpg"], "--plot must end in .png"),
        (["--reference-context", "2048"], "give --window-tokens too"),
        (["--window-tokens", "64", "--slots", "16", "--reference-context", "-1"], "--reference-context must be >= 0"),
        (["--window-tokens", "64"], "needs --slots"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["eval", "ppl", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error:") and message in err
    assert "\n" not in err


class CharTokenizer:
    """Enough of a tokenizer for ``text_segments``: one id per character, inside the tiny vocab."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + ord(c) % (VOCAB - 4) for c in text]}


def test_cli_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    model = tiny_model("llama", seed=5)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, CharTokenizer()))
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question. " * 10)
    out_json, out_png = tmp_path / "r.json", tmp_path / "p.png"
    argv = ["eval", "ppl", "--text", str(text), "--tokens", "64", "--segments", "2", "--policies", "full,h2o,sink,snapkv:16",
            "--budgets", "0.25,0.5", "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    rows = json.loads(out_json.read_text())
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", 1.0), ("h2o", 0.25), ("h2o", 0.5), ("sink", 0.25),
                                                          ("sink", 0.5), ("snapkv:16", 0.25), ("snapkv:16", 0.5)]
    assert {"policy", "budget", "tokens", "ppl", "ppl_ratio_to_full"} <= set(rows[0])
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "h2o" in table and "sink" in table
    # too little text for the segments asked for
    assert main([*argv[:6], "--segments", "50", "--plot", str(out_png)]) == 2
    assert "segment(s) of 64 need" in capsys.readouterr().err


@pytest.mark.integration
def test_default_model_h2o_close_to_full_and_better_than_local(default_model):
    from h2okv.corpus import read_play
    from h2okv.eval.text import text_segments

    model, tokenizer = default_model
    ids = text_segments(tokenizer, read_play("hamlet_gut"), 384)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per-token steps: see ppl.apply_threads
    try:
        (h2o, local), full_ppl = ppl_grid(model, ids, ["h2o", "local"], [0.2], progress=False)
    finally:
        torch.set_num_threads(threads)
    assert 5 < full_ppl < 100  # a trained model on English verse, not noise
    assert h2o.ppl_ratio_to_full < 1.1
    assert local.ppl > 1.5 * h2o.ppl


def test_dataset_text_from_a_local_dataset_folder(tmp_path):
    from h2okv.eval.text import load_dataset_text

    (tmp_path / "part.txt").write_text("first line\n\nsecond line\n")
    assert load_dataset_text(str(tmp_path)) == "first line\nsecond line"
    with pytest.raises(H2OError, match="has no split 'validation'"):
        load_dataset_text(str(tmp_path), split="validation")
    with pytest.raises(H2OError, match="cannot load dataset"):
        load_dataset_text(str(tmp_path / "missing"))


def test_kv_bits_rows_come_beside_the_float_ones_and_fewer_bits_cost_more(llama):
    from h2okv.cli.eval.ppl import parse_kv_bits

    assert parse_kv_bits(None) == (None,) and parse_kv_bits("4,none,8") == (None, 4, 8)
    with pytest.raises(H2OError, match="--kv-bits takes 8, 4, 2 or none"):
        parse_kv_bits("3")
    ids = random_ids(48, batch=1, seed=2)
    rows, full_ppl = ppl_grid(llama, ids, ["h2o"], [0.5], progress=False, kv_bits=(None, 8, 2), coding={"kv_group": 8})
    assert [r.label for r in rows] == ["full 8-bit", "full 2-bit", "h2o", "h2o 8-bit", "h2o 2-bit"]
    by = {r.label: r.ppl for r in rows}
    # 8 bits barely move the reference; 2 bits move it more; quantization alone keeps every token
    assert abs(by["full 8-bit"] / full_ppl - 1) < abs(by["full 2-bit"] / full_ppl - 1)
    assert all(r.slots == 48 for r in rows if r.policy == "full")
    assert {r.kv_group for r in rows if r.kv_bits} == {8}
    rows, _ = ppl_grid(llama, ids, ["h2o"], [0.5], progress=False, kv_bits=(4,), coding={"kv_group": 8, "key_bits": 8})
    assert [r.label for r in rows] == ["full k8v4", "h2o k8v4"]
