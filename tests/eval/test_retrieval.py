import json

import pytest
import torch

import h2okv.eval.retrieval
import h2okv.models
from char_tokenizers import CharTokenizer
from h2okv.cli import main
from h2okv.cli.args import int_list
from h2okv.cli.eval.retrieval import parse_depths
from h2okv.core.compat import cache_arg
from h2okv.core.reconstruction import reconstruct
from h2okv.errors import H2OError
from h2okv.eval.haystack import FILLER
from h2okv.eval.retrieval import (
    INSTRUCTION,
    NEEDLE,
    QUESTION,
    Haystack,
    RetrievalSpec,
    build_prompt,
    is_correct,
    make_prompts,
    retrieval_grid,
    run_batch,
)
from h2okv.generation import new_cache
from h2okv.tools.tiny import tiny_model


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


@pytest.fixture(scope="module")
def filler(tok):
    return Haystack(tok, "filler")


def test_prompt_has_exact_length_and_needle_where_asked(tok, filler):
    head = len(INSTRUCTION)
    for depth in (0.0, 0.5, 1.0):
        p = build_prompt(tok, filler, 600, depth, "48213")
        assert len(p.ids) == 600
        text = tok.decode(p.ids)
        start, stop = p.needle
        assert tok.decode(p.ids[start:stop]) == NEEDLE.format(key="48213")
        assert text.startswith(INSTRUCTION) and text.endswith(QUESTION)
        hay_len = 600 - head - len(NEEDLE.format(key="48213")) - len(QUESTION)
        if depth == 0.0:
            assert start == head
        elif depth == 1.0:
            assert stop == 600 - len(QUESTION)
        else:  # at a sentence boundary of the filler, within one filler sentence group of the middle
            assert text[start - 2 : start] == ". "
            assert abs((start - head) - hay_len / 2) <= 90


def test_filler_has_no_end_and_keeps_its_sentence_breaks(tok):
    """RULER's filler repeats to any length (a 32k prompt once found only its first 8k tokens)."""
    hay = Haystack(tok, "filler")
    unit = len(tok(FILLER, add_special_tokens=False)["input_ids"])
    ids, breaks = hay.take(40_000, offset=5)
    assert len(ids) == 40_000
    assert tok.decode(ids[unit - 5 : 2 * unit - 5]) == FILLER  # offset 5: the second whole sentence group
    assert [b for b in breaks if 0 < b < 40_000] == list(range(unit - 5, 40_000, unit))
    assert len(build_prompt(tok, hay, 50_000, 0.5, "48213").ids) == 50_000


def test_prompt_too_short_and_bad_depth(tok, filler):
    with pytest.raises(H2OError, match="context 100 is too short"):
        build_prompt(tok, filler, 100, 0.5, "12345")
    with pytest.raises(H2OError, match=r"depth must be in \[0, 1\]"):
        build_prompt(tok, filler, 600, 1.5, "12345")


def test_prompts_are_reproducible_and_varied(tok, filler):
    a = make_prompts(tok, filler, 500, [0.0, 1.0], trials=3, seed=7)
    b = make_prompts(tok, filler, 500, [0.0, 1.0], trials=3, seed=7)
    assert [p.passkey for p in a] == [p.passkey for p in b]
    assert len({p.passkey for p in a}) == 6
    assert [p.depth for p in a] == [0.0] * 3 + [1.0] * 3
    assert [p.passkey for p in make_prompts(tok, filler, 500, [0.0, 1.0], trials=3, seed=8)] != [p.passkey for p in a]


def test_scoring():
    assert is_correct(" 48213. Remember", "48213")
    assert not is_correct(" 4821 3", "48213")
    assert not is_correct(" the pass key", "48213")


def test_needle_kept_shows_where_local_eviction_loses_it(tok, filler):
    model = tiny_model("llama", seed=1)
    prompts = make_prompts(tok, filler, 400, [0.0, 1.0], trials=1)
    _, kept_full = run_batch(model, tok, prompts, "full", None, chunk_size=64, max_new_tokens=4)
    assert kept_full == [1.0, 1.0]
    # a sliding window of 200 tokens: the early needle is gone, the late one (within the last
    # 200 tokens with the question and the answer) is intact
    _, kept = run_batch(model, tok, prompts, "local", 0.5, chunk_size=32, max_new_tokens=4)
    assert kept[0] == 0.0
    assert kept[1] == pytest.approx(1.0)


def test_grid_cells(tok):
    model = tiny_model("llama", seed=2)
    spec = RetrievalSpec(["full", "h2o"], [0.5], [300], [0.0, 1.0], trials=2, chunk_size=128, max_new_tokens=3)
    cells = retrieval_grid(model, tok, spec, progress=False)
    assert [(c.policy, c.budget, c.depth) for c in cells] == [("full", 1.0, 0.0), ("full", 1.0, 1.0), ("h2o", 0.5, 0.0), ("h2o", 0.5, 1.0)]
    for c in cells:
        assert c.trials == 2 and len(c.answers) == 2 and c.accuracy == c.correct / 2
        assert 0.0 <= c.needle_kept <= 1.0


def test_kvzip_reads_late_and_is_ranked_by_reconstruction_before_it_answers(tok, filler):
    """kvzip: all but the last token read whole, ranked by the probe, then generate: the cache
    that answers holds its budget (the needle share is of kept tokens), and a cell says late."""
    model = tiny_model("llama", seed=4, num_attention_heads=4, num_key_value_heads=2)
    prompts = make_prompts(tok, filler, 300, [0.0, 1.0], trials=1)
    answers, kept = run_batch(model, tok, prompts, "kvzip", 0.3, chunk_size=64, max_new_tokens=4)
    cache = new_cache(model, "kvzip", 0.3, chunk_size=64, prefill="late")
    ids = torch.tensor([p.ids for p in prompts])
    with torch.inference_mode():
        model(input_ids=ids[:, :-1], **cache_arg(cache))
        reconstruct(model, cache, ids[:, :-1], tok)
        out = model.generate(ids, **cache_arg(cache), max_new_tokens=4, do_sample=False, pad_token_id=1)
    assert answers == tok.batch_decode(out[:, ids.shape[1]:])
    for layer in cache.layers:
        assert (layer.valid.sum(-1) <= int(layer.slot_budget().max()) + 1).all()
    assert all(0.0 <= k <= 1.0 for k in kept)
    spec = RetrievalSpec(["kvzip"], [0.3], [300], [0.0], trials=1, chunk_size=64, max_new_tokens=2)
    cells = retrieval_grid(model, tok, spec, progress=False)
    assert cells[0].prefill == "late" and cells[0].policy == "kvzip"


@pytest.mark.parametrize(
    "text, ok",
    [("512,1024", [512, 1024]), ("1024,512,512", [1024, 512, 512])],
)
def test_int_list(text, ok):
    assert int_list(text) == ok  # in the order given: eval retrieval sorts and deduplicates its contexts


def test_parse_depths():
    assert parse_depths("1,0,0.5") == [0.0, 0.5, 1.0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--contexts", "512,abc"], "argument --contexts: expected comma-separated positive integers"),
        (["--contexts", "0"], "argument --contexts: expected comma-separated positive integers"),
        (["--depths", "0.5,2"], "--depths must be fractions in [0, 1]"),
        (["--haystack", "lorem"], "--haystack must be 'filler' or shakespeare:NAME"),
        (["--policies", "h2o,lru"], "unknown policy 'lru'"),
        (["--budgets", "0"], "must be a fraction"),
        (["--json", "/"], "is a directory"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["eval", "retrieval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error:") and message in err and "\n" not in err


def test_cli_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    model = tiny_model("llama", seed=3)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, CharTokenizer()))
    out_json, out_png = tmp_path / "r.json", tmp_path / "h.png"
    argv = ["eval", "retrieval", "--contexts", "300", "--depths", "0,1", "--trials", "1", "--policies", "full,local",
            "--budgets", "0.3,0.6", "--max-new-tokens", "2", "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    rows = json.loads(out_json.read_text())
    assert {(r["policy"], r["budget"]) for r in rows} == {("full", 1.0), ("local", 0.3), ("local", 0.6)}
    assert len(rows) == 3 * 2
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert "needle kept" in capsys.readouterr().out


def test_cli_head_floor_reaches_the_cache_and_the_rows(tmp_path, monkeypatch):
    # --head-floor is one of the grid's cache settings (it once failed the grid with a TypeError)
    model = tiny_model("llama", seed=3)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, CharTokenizer()))
    built = []
    monkeypatch.setattr(h2okv.eval.retrieval, "new_cache", lambda *a, **k: built.append(k) or new_cache(*a, **k))
    out_json = tmp_path / "r.json"
    argv = ["eval", "retrieval", "--contexts", "300", "--depths", "0", "--trials", "1", "--policies",
            "snapkv:window=1", "--budgets", "0.2", "--max-new-tokens", "1", "--head-budgets", "adaptive",
            "--head-floor", "0.5", "--json", str(out_json), "--plot", ""]
    assert main(argv) == 0
    assert built and all(k["head_floor"] == 0.5 and k["head_budgets"] == "adaptive" for k in built)
    assert [r["head_floor"] for r in json.loads(out_json.read_text())] == [0.5]


def test_shakespeare_haystack_cuts_at_line_ends(tok):
    hay = Haystack(tok, "shakespeare:hamlet_gut")
    prompts = make_prompts(tok, hay, 700, [0.5], trials=2, seed=1)
    assert prompts[0].ids != prompts[1].ids  # different stretches of the play
    for p in prompts:
        start, _ = p.needle
        assert len(p.ids) == 700 and tok.decode([p.ids[start - 1]]) == "\n"


def test_exported_prompts_are_the_ids_the_grid_feeds_the_model(tmp_path, monkeypatch):
    """The kvpress adapter runs on the export: it must hold exactly what ``eval retrieval`` generates
    from, split at the question, with the passkeys it scores against."""
    model = tiny_model("llama", seed=3)
    model.name_or_path = "/converted/folder"
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, CharTokenizer()))
    fed = []
    generate = model.generate

    def recording_generate(input_ids, **kwargs):
        fed.extend(input_ids.tolist())
        return generate(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "generate", recording_generate)
    grid = ["--contexts", "300,360", "--depths", "0,0.5,1", "--trials", "2", "--budgets", "0.2", "--seed", "4"]
    export = tmp_path / "prompts.json"
    assert main(["eval", "retrieval", *grid, "--export-prompts", str(export)]) == 0
    assert fed == []  # exporting runs nothing
    assert main(["eval", "retrieval", *grid, "--policies", "full", "--max-new-tokens", "1",
                 "--json", str(tmp_path / "r.json"), "--plot", ""]) == 0
    data = json.loads(export.read_text())
    assert data["format"] == "h2okv-retrieval-prompts/1" and data["model"] == "/converted/folder"
    assert (data["budgets"], data["decoding"], data["seed"]) == ([0.2], "greedy", 4)
    assert [p["context_ids"] + p["question_ids"] for p in data["prompts"]] == fed
    question = CharTokenizer()(QUESTION)["input_ids"]
    assert all(p["question_ids"] == question for p in data["prompts"])
    rows = json.loads((tmp_path / "r.json").read_text())
    answers_by_cell = {(r["context"], r["depth"]): r for r in rows}
    for p in data["prompts"]:
        assert len(answers_by_cell[p["context"], p["depth"]]["answers"]) == 2
        start, stop = p["needle"]
        assert p["passkey"] in CharTokenizer().decode(p["context_ids"][start:stop])
