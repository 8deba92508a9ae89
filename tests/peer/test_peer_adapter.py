"""tools/peer/run_kvpress.py without kvpress (it lives in .venv-peer only): its rows merge with
``eval retrieval``'s, and its decoding, with no press, equals ``generate``'s greedy decoding in both
modes (the question read with the context, or on top of the context's cache)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from h2okv.eval.retrieval import Cell, summary_table
from h2okv.tools.tiny import tiny_model
from source_imports import top_level_imports
from tool_scripts import load_tool

# the peer runs in its own venv on transformers < 5.3, which knows the cache only as past_key_values
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

ADAPTER = Path(__file__).resolve().parents[2] / "tools" / "peer" / "run_kvpress.py"


@pytest.fixture(scope="module")
def adapter():
    return load_tool("peer/run_kvpress.py")


class IdTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def test_adapter_does_not_import_h2okv():
    """h2okv is not installed in the peer's venv."""
    imported = top_level_imports(ADAPTER)
    assert "h2okv" not in imported and {"torch", "transformers", "kvpress"} <= imported


def test_rows_have_the_shape_of_eval_retrieval_rows(adapter):
    exported = {"haystack": "filler", "prompts": [
        {"context": 64, "depth": d, "passkey": key} for d, key in [(0.0, "111"), (0.0, "222"), (1.0, "333"), (1.0, "4")]]}
    rows = adapter.cells(exported, ["111.", "x", "333", "no"], "kvpress-knorm", 0.2)
    # every field of h2okv's rows, except the shape of h2okv's own cache (recent share, head budgets):
    # a press has none
    own = {"recent_share", "head_budgets", "head_floor", "positions", "recipe"}
    assert [set(r) for r in rows] == [{f.name for f in dataclasses.fields(Cell)} - own] * 2
    assert [r["prefill"] for r in rows] == ["late"] * 2  # a press ranks once, after the prompt
    assert [(r["depth"], r["correct"], r["trials"], r["accuracy"]) for r in rows] == [(0.0, 1, 2, 0.5), (1.0, 1, 2, 0.5)]
    assert rows[0]["answers"] == ["111.", "x"]
    ours = [Cell("h2o", 0.2, 64, depth, 2, 2, 1.0, 0.5, "filler", 64, ["111", "222"]) for depth in (0.0, 1.0)]
    table = summary_table([*ours, *(Cell(**r) for r in rows)])  # the two merge into one table
    assert "kvpress-knorm" in table and "h2o" in table and "50%" in table


@pytest.mark.parametrize("mode", ["question-compressed", "question-out"])
def test_no_press_decodes_as_generate(adapter, mode):
    model = tiny_model("llama", seed=5)
    model.generation_config.eos_token_id = None
    torch.manual_seed(0)
    ids = torch.randint(2, 90, (1, 40))
    prompt = {"context_ids": ids[0, :32].tolist(), "question_ids": ids[0, 32:].tolist()}
    answer = adapter.answer_one(model, IdTokenizer(), None, prompt, mode, max_new_tokens=6)
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert answer == IdTokenizer().decode(expected[0, 40:].tolist())


@pytest.mark.parametrize("question, mode", [("aware", "question-compressed"), ("agnostic", "question-out")])
def test_longctx_export_is_read_token_identical_and_scored_as_h2okv_scores(adapter, question, mode, tmp_path):
    """The adapter feeds the model exactly the ids ``eval longctx`` feeds it, and with no press its
    rows equal h2okv's ``full`` rows (answers, scores, shape): the metric is one file, loaded by path."""
    from char_tokenizers import Chars
    from h2okv.eval.longctx.rows import ROW_FIELDS
    from h2okv.eval.longctx.runner import GridSpec, export_prompts, grid_prompts, run_grid

    tok, model = Chars(), tiny_model("llama", seed=6, max_position_embeddings=2048)
    spec = GridSpec(tasks=["niah_single_1", "fwe"], contexts=[700], samples=2, policies=["full"], budgets=[0.2],
                    haystack="filler", max_new_tokens=4, question=question)
    exported = export_prompts("m", tok, spec)
    ours = {(r["task"], r["sample"]): r for r in run_grid(model, tok, spec, progress=False)}
    fed = []
    inner = model.model.forward

    def recording(*args, **kwargs):
        fed.append(kwargs["input_ids"][0].tolist())
        return inner(*args, **kwargs)

    model.model.forward = recording
    out = tmp_path / "kvpress.json"
    rows = adapter.run_longctx(exported, ["full"], [mode], [0.2], "m", models={"sdpa": (model, tok)}, out=str(out))
    prompts = [p for group in grid_prompts(tok, spec).values() for p in group]
    reads = [ids for ids in fed if len(ids) > 1]  # prompt reads, not decode steps
    if question == "aware":
        assert reads == [p.ids for p in prompts]
    else:  # the context, then the question on its cache
        assert reads == [part for p in prompts for part in (p.ids[: p.question], p.ids[p.question :])]
    assert len(rows) == len(ours) == 4
    for row in rows:
        assert tuple(row) == ROW_FIELDS and row["question"] == question and row["policy"] == "kvpress-full"
        mine = ours[row["task"], row["sample"]]
        assert (row["answer"], row["score"], row["references"]) == (mine["answer"], mine["score"], mine["references"])
    fed.clear()  # a second run on the same file resumes: nothing left to run
    assert adapter.run_longctx(exported, ["full"], [mode], [0.2], "m", models={"sdpa": (model, tok)},
                               out=str(out)) == rows == json.loads(out.read_text())
    assert fed == []


def test_several_questions_a_context_give_rows_that_pair_with_the_reuse_grids(adapter, tmp_path):
    """An export of several questions a context: with no press the adapter's rows are ``eval longctx
    --questions-per-context``'s full rows, mode for mode (the context compressed before the question
    is ``reuse``, read with it ``fresh``), each with its question's index; a second run resumes."""
    from char_tokenizers import Chars
    from h2okv.eval.longctx.reuse import run_reuse_grid
    from h2okv.eval.longctx.rows import row_key
    from h2okv.eval.longctx.runner import GridSpec, export_prompts

    class EosChars(Chars):
        eos_token_id = None  # h2okv.ask reads it

    tok, model = EosChars(), tiny_model("llama", seed=6, max_position_embeddings=2048)
    model.generation_config.eos_token_id = None
    spec = GridSpec(tasks=["niah_single_1"], contexts=[700], samples=2, policies=["full"], budgets=[0.2],
                    haystack="filler", max_new_tokens=4, questions=2)
    ours = {(r["question"], r["sample"], r["question_index"]): r for r in run_reuse_grid(model, tok, spec, progress=False)}
    exported = export_prompts("m", tok, spec)
    out = tmp_path / "kvpress.json"
    modes = ["question-out", "question-compressed"]
    rows = adapter.run_longctx(exported, ["full"], modes, [0.2], "m", models={"sdpa": (model, tok)}, out=str(out))
    assert len(rows) == len(ours) == 8
    for row in rows:
        mine = ours[row["question"], row["sample"], row["question_index"]]
        assert row["questions"] == 2 and row["policy"] == "kvpress-full"
        assert (row["answer"], row["score"]) == (mine["answer"], mine["score"])
    assert {r["question"] for r in rows} == {"reuse", "fresh"}
    assert len({row_key(r) for r in rows}) == 8  # each question its own cell: none replaces another in a merge
    assert adapter.run_longctx(exported, ["full"], modes, [0.2], "m", models={"sdpa": (model, tok)},
                               out=str(out)) == rows


def test_longctx_run_stopped_mid_press_resumes_from_the_prompts_it_wrote(adapter, tmp_path, monkeypatch):
    """Each prompt's row is written as soon as it is answered: a press killed after two prompts
    leaves two rows, and the rerun answers only the other prompts (KVzip on the 1.5B model takes
    minutes a prompt, so losing a whole press to a session's end costs an hour)."""
    from char_tokenizers import Chars
    from h2okv.eval.longctx.runner import GridSpec, export_prompts

    tok, model = Chars(), tiny_model("llama", seed=6, max_position_embeddings=2048)
    spec = GridSpec(tasks=["niah_single_1", "fwe"], contexts=[700], samples=2, policies=["full"], budgets=[0.2],
                    haystack="filler", max_new_tokens=4, question="aware")
    exported = export_prompts("m", tok, spec)
    out = tmp_path / "kvpress.json"
    answered, inner = [], adapter.answer_one

    def dies_on_the_third(model, tokenizer, press, prompt, mode, max_new_tokens, *rest):
        if len(answered) == 2:
            raise KeyboardInterrupt
        answered.append((prompt["task"], prompt["sample"]))
        return inner(model, tokenizer, press, prompt, mode, max_new_tokens, *rest)

    monkeypatch.setattr(adapter, "answer_one", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        adapter.run_longctx(exported, ["full"], ["question-compressed"], [0.2], "m",
                            models={"sdpa": (model, tok)}, out=str(out))
    kept = json.loads(out.read_text())
    assert [(r["task"], r["sample"]) for r in kept] == answered
    monkeypatch.setattr(adapter, "answer_one", inner)
    rerun = []
    monkeypatch.setattr(adapter, "longctx_rows", lambda exported, prompts, *a, _f=adapter.longctx_rows:
                        rerun.extend((p["task"], p["sample"]) for p in prompts) or _f(exported, prompts, *a))
    rows = adapter.run_longctx(exported, ["full"], ["question-compressed"], [0.2], "m",
                               models={"sdpa": (model, tok)}, out=str(out))
    assert len(rows) == 4 and not set(rerun) & set(answered) and len(rerun) == 2
    assert rows == json.loads(out.read_text())


def test_quantized_cache_runs_are_parsed_early_and_their_bytes_counted_against_16_bits(adapter):
    """``--quantized-cache quanto:2,quanto:4``: transformers' QuantizedCache as the baseline of
    quantization alone (optimum-quanto lives in the peer's venv only, so here: the spelling, and the
    byte count on a plain cache, which a 16-bit full cache holds at exactly 1.0 and fp32 at 2.0)."""
    from transformers import DynamicCache

    assert adapter.parse_quantized(None) == [None]
    assert adapter.parse_quantized("quanto:2, quanto:4") == [
        {"backend": "quanto", "nbits": bits, "q_group_size": 64, "residual_length": 128} for bits in (2, 4)]
    for bad in ("quanto", "quanto:3", "awq:4"):
        with pytest.raises(SystemExit, match="--quantized-cache takes BACKEND:BITS"):
            adapter.parse_quantized(bad)
    for dtype, share in ((torch.bfloat16, 1.0), (torch.float32, 2.0)):
        model = tiny_model("llama", seed=1).to(dtype)
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.randint(2, 90, (1, 20)), past_key_values=cache)
        assert adapter.share_of_16bit(cache, model, 20) == share
        assert adapter.share_of_16bit(cache, model, 40) == share / 2  # a press kept half of what was read
        assert adapter.tensor_bytes(cache.layers[0].keys) == cache.layers[0].keys.numel() * dtype.itemsize
    # HQQ keeps (packed codes, meta): the meta's scales and zeros count, its shapes and dtypes do not
    codes, scale, zero = torch.zeros(4, 16, dtype=torch.uint8), torch.ones(8, 1), torch.ones(8, 1, dtype=torch.float16)
    hqq = (codes, {"scale": scale, "zero": zero, "shape": (1, 2, 8, 64), "nbits": 2, "compute_dtype": torch.float32})
    assert adapter.tensor_bytes(hqq) == 64 + 8 * 4 + 8 * 2
