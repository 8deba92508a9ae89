"""``eval reasoning``: the offline loader on a fixture of the OLMES request format, batched greedy
decoding (each row equal to its batch-of-one run, every policy), absolute budgets kept through long
generations, the grid and its report."""

from pathlib import Path

import pytest

from h2okv import H2OCache
from h2okv.errors import H2OError
from h2okv.eval.greedy import greedy_rows
from h2okv.eval.reasoning_data import load_problems
from h2okv.generation import new_cache
from h2okv.policy_names import POLICY_NAMES
from h2okv.tools.tiny import random_ids

FIXTURE = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "oe_eval_tasks"


# -- the offline loader ----------------------------------------------------------------------------
def test_loader_reads_gsm8k_requests():
    problems = load_problems("gsm8k", root=FIXTURE)
    assert [p.id for p in problems] == [0, 1, 2, 3]
    first = problems[0]
    assert first.question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first.gold == "18"
    assert first.fewshot_context.startswith("Question: There are 15 trees")
    assert first.fewshot_context.endswith(first.question + "\nAnswer:")
    assert "\n\n" in first.stop and "Question:" in first.stop


def test_loader_reads_math500_gold_from_the_solution():
    problems = load_problems("math500", root=FIXTURE)
    first = problems[0]
    assert first.question.startswith("Convert the point $(0,3)$")
    # the file's doc.answer is "\le(3,..." (an old normaliser ate "ft"); the solution's box is intact
    assert first.gold == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first.fewshot_context.endswith("Solution:")


def test_loader_slices_and_errors(tmp_path):
    assert [p.id for p in load_problems("gsm8k", limit=2, offset=1, root=FIXTURE)] == [1, 2]
    with pytest.raises(H2OError, match="no problems"):
        load_problems("gsm8k", offset=10, root=FIXTURE)
    with pytest.raises(H2OError, match="unknown reasoning task"):
        load_problems("aime", root=FIXTURE)
    with pytest.raises(H2OError, match="make eval-data"):
        load_problems("gsm8k", root=tmp_path)


# -- batched greedy decoding -----------------------------------------------------------------------
def budget_of(policy):
    return {} if policy == "full" else {"slots": 9}


def run(model, prompts, policy, eos, steps=14):
    cache = new_cache(model, policy, seed=3, **budget_of(policy))
    return greedy_rows(model, prompts, cache, steps, eos_ids=eos), cache


# every policy but random, whose draws come from one generator for the whole batch, and kvzip,
# which ranks a prompt by reconstruction: `eval reasoning` refuses it (test_kvzip)
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p not in ("random", "kvzip")])
def test_batch_equals_batch_of_one_for_every_policy(llama, policy):
    """Left-padded rows of different lengths that finish at different steps (so the batch shrinks
    under the others): every row's tokens equal its run alone."""
    prompts = [random_ids(n, seed=20 + i)[0].tolist() for i, n in enumerate([23, 11, 17, 30])]
    free, _ = run(llama, prompts, policy, eos=set())
    # an EOS that row 1 meets part-way: rows that produce it stop early, the others go on
    eos = {free[1].token_ids[4]}
    batch, _ = run(llama, prompts, policy, eos)
    assert len({len(r.token_ids) for r in batch}) > 1, "the rows should finish at different steps"
    for prompt, row in zip(prompts, batch, strict=True):
        alone, _ = run(llama, [prompt], policy, eos)
        assert row.token_ids == alone[0].token_ids
        assert row.finish == alone[0].finish
        assert row.kv_slots == alone[0].kv_slots


def test_stop_strings_end_a_row():
    decode = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    from h2okv.tools.tiny import tiny_model

    model = tiny_model("qwen2")
    prompt = random_ids(12, seed=5)[0].tolist()
    free = greedy_rows(model, [prompt], new_cache(model, "h2o", slots=8), 10, eos_ids=set())[0]
    stop = (f"w{free.token_ids[3]}",)
    first = next(i for i, t in enumerate(free.token_ids) if f"w{t}" == stop[0])
    cut = greedy_rows(model, [prompt], new_cache(model, "h2o", slots=8), 10, eos_ids=set(), stop=stop, decode=decode)[0]
    assert cut.finish == "stop" and cut.token_ids == free.token_ids[: first + 1]


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "local", "sink", "h2o-mean", "h2o-sink", "random"])
def test_absolute_budget_kept_through_long_generation(llama, policy):
    """12 slots per (layer, head), 10- and 6-token prompts, 60 new tokens (6x the budget): the cache
    never holds more than the budget (plus the one slot the next token is written into)."""
    prompts = [random_ids(10, seed=1)[0].tolist(), random_ids(6, seed=2)[0].tolist()]
    cache = new_cache(llama, policy, slots=12)
    rows = greedy_rows(llama, prompts, cache, 60, eos_ids=set())
    assert [len(r.token_ids) for r in rows] == [60, 60]
    assert [r.kv_slots for r in rows] == [12, 12]
    stats = cache.stats()
    assert stats["budget"] == [12, 12] and max(stats["slots"]) == 12
    assert max(stats["capacity"]) <= 12 + 1
    assert stats["tokens_seen"] >= 10 + 59


def test_slot_budget_splits_half_and_half(llama):
    cache = new_cache(llama, "h2o", slots=9)
    assert (cache.spec.heavy, cache.spec.recent) == (4, 5)
    assert isinstance(new_cache(llama, "full", slots=9), H2OCache) and new_cache(llama, "full", slots=9).spec.heavy is None


def test_slot_budget_takes_a_recent_share(llama):
    cache = new_cache(llama, "h2o", slots=128, recent_share=0.25)
    assert (cache.spec.heavy, cache.spec.recent) == (96, 32)
    with pytest.raises(H2OError, match="recent_share= 0.0 leaves tova no recent slots"):
        new_cache(llama, "tova", slots=10, recent_share=0.0)  # a score policy keeps its newest token
    with pytest.raises(H2OError, match="recent_share= must be a number in"):
        new_cache(llama, "h2o", slots=10, recent_share=1.5)


# -- the command, its pieces and the report -------------------------------------------------------
@pytest.fixture
def tiny_chat(monkeypatch):
    """``load_model`` returns a tiny chat model; the problems are the fixture's."""
    import h2okv.models
    from h2okv.tools.tiny_chat import tiny_chat_model

    pair = tiny_chat_model(layers=2)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *args, **kwargs: pair)
    monkeypatch.setenv("H2OKV_OE_EVAL_TASKS", str(FIXTURE))
    return pair


def test_pieces_merge_into_one_report(tiny_chat, tmp_path, capsys):
    import json

    from h2okv.cli import main

    common = ["eval", "reasoning", "--limit", "3", "--max-new-tokens", "6", "--batch-size", "2"]
    full, h2o = tmp_path / "full.json", tmp_path / "h2o.json"
    assert main([*common, "--policies", "full", "--json", str(full), "--keep-text"]) == 0
    assert all(isinstance(r["text"], str) for r in json.loads(full.read_text())["rows"])
    for r in json.loads(full.read_text())["rows"]:  # full holds every token read (the last one generated is not)
        final = r["prompt_tokens"] + r["new_tokens"]
        assert r["kv_share_16bit"] == pytest.approx((final - 1) / final, abs=1e-4)
        assert r["kv_bytes_16bit"] * 2 == r["kv_bytes"]  # the tiny model's float32, counted as 16-bit
    assert main([*common, "--policies", "h2o,local", "--budgets", "0.5,24", "--json", str(h2o)]) == 0
    piece = json.loads(h2o.read_text())
    assert len(piece["rows"]) == 2 * 2 * 3 and len(piece["batches"]) == 2 * 2 * 2  # 3 problems in batches of 2
    assert {r["budget"] for r in piece["rows"]} == {0.5, 24}  # a fraction and a slot count, told apart
    import transformers

    assert {b["software"]["transformers"] for b in piece["batches"]} == {transformers.__version__}
    assert all(r["kv_slots"] <= 24 for r in piece["rows"] if r["budget"] == 24)
    assert {r["settings"]["policy"] for r in piece["rows"]} == {"h2o", "local"}  # each row's full cache settings
    # resuming a finished piece runs nothing and keeps it whole
    assert main([*common, "--policies", "h2o,local", "--budgets", "0.5,24", "--json", str(h2o), "--resume"]) == 0
    assert json.loads(h2o.read_text())["rows"] == piece["rows"]
    out, plot = tmp_path / "merged.json", tmp_path / "acc.png"
    assert main(["eval", "reasoning-report", str(full), str(h2o), "--json", str(out), "--plot", str(plot)]) == 0
    summaries = json.loads(out.read_text())["summaries"]
    assert [(s["policy"], s["budget"]) for s in summaries] == [
        ("full", None), ("h2o", 0.5), ("local", 0.5), ("h2o", 24), ("local", 24)]
    assert all(s["n"] == 3 and s["agreement"] is not None and s["tokens_per_s"] > 0 and s["tokens_per_cpu_s"] > 0
               for s in summaries)
    assert summaries[0]["agreement"] == 1.0
    assert plot.stat().st_size > 0
    by_kv = tmp_path / "kv.png"
    assert main(["eval", "reasoning-report", str(full), str(h2o), "--plot", str(by_kv), "--x", "kv"]) == 0
    assert by_kv.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "agree w/ full" in printed and "KV of 16-bit full" in printed


def _row(policy, budget, id, correct, task="gsm8k"):
    return {"model": "m", "task": task, "style": "chat", "policy": policy, "budget": budget, "id": id,
            "predicted": "1" if correct else "2", "gold": "1", "correct": correct, "new_tokens": 10,
            "prompt_tokens": 5, "finish": "eos", "kv_bytes": 0}


def test_accuracy_against_kv_bytes_puts_every_budget_on_one_axis(tmp_path):
    """x="kv": slots and fractions in one panel, each line sorted by the MiB it holds, full as a
    point at its own; x="budget": a panel per kind of budget, full in each; a bad axis: one line."""
    from h2okv.errors import H2OError
    from h2okv.eval.reasoning_report import accuracy_lines, plot_accuracy, summarize

    def rows(policy, budget, mib, correct):
        return [{**_row(policy, budget, i, i < correct), "kv_bytes": mib * 2**20} for i in range(4)]

    summaries = summarize([*rows("full", None, 8, 4), *rows("h2o", 256, 3, 2), *rows("h2o", 128, 1.5, 1),
                           *rows("rkv", 128, 1.5, 3), *rows("h2o", 0.5, 4, 3)], [])
    (key, lines), = accuracy_lines(summaries, "kv").items()
    assert key == ("m", "gsm8k", "chat")
    assert lines["h2o"] == [(1.5, 0.25, lines["h2o"][0][2]), (3.0, 0.5, lines["h2o"][1][2]), (4.0, 0.75, lines["h2o"][2][2])]
    assert [p[:2] for p in lines["rkv"]] == [(1.5, 0.75)] and [p[:2] for p in lines["full"]] == [(8.0, 1.0)]
    by_budget = accuracy_lines(summaries, "budget")
    assert sorted(by_budget) == [("m", "gsm8k", "chat", False), ("m", "gsm8k", "chat", True)]
    assert [p[0] for p in by_budget["m", "gsm8k", "chat", True]["h2o"]] == [128, 256]
    assert all("full" in lines for lines in by_budget.values())
    assert plot_accuracy(summaries, tmp_path / "kv.png", "kv").stat().st_size > 0
    with pytest.raises(H2OError, match="x axis must be one of budget, kv"):
        accuracy_lines(summaries, "bytes")


def test_accuracy_against_a_16_bit_cache_s_share_puts_float_and_coded_slots_on_one_axis(tmp_path):
    """x="kv16": a row of float slots (recorded before the share was) at its live slots over its
    tokens, whatever dtype it ran in; a quantized row at its recorded share; full at 100%."""
    from h2okv.errors import H2OError
    from h2okv.eval.reasoning_report import accuracy_lines, plot_accuracy, summarize

    def rows(policy, budget, correct, **more):
        return [{**_row(policy, budget, i, i < correct), "kv_bytes": 2**20, **more} for i in range(4)]

    # 15 tokens a problem: 6 float slots are 40% of a full cache; coded rows say their own share
    summaries = summarize([*rows("full", None, 4), *rows("rkv", 6, 2, kv_slots=6),
                           *rows("rkv kv_bits=k8v4", 9, 3, kv_slots=9, kv_bits=4, kv_share_16bit=0.25)], [])
    (_, lines), = accuracy_lines(summaries, "kv16").items()
    assert [p[:2] for p in lines["rkv"]] == [(pytest.approx(40.0), 0.5)]
    assert [p[:2] for p in lines["rkv kv_bits=k8v4"]] == [(25.0, 0.75)] and lines["full"][0][:2] == (100.0, 1.0)
    assert plot_accuracy(summaries, tmp_path / "kv16.png", "kv16").stat().st_size > 0
    unknown = summarize([*rows("full", None, 4), *rows("h2o", 6, 2, kv_bits=4)], [])  # coded, share not recorded
    with pytest.raises(H2OError, match="no share of a 16-bit cache"):
        accuracy_lines(unknown, "kv16")


def test_common_keeps_the_problems_every_policy_ran():
    """A full piece of 4 problems beside a screening piece of the first 2: --common compares both on
    problems 0-1 only, per (model, task, style) (math500 has its own set)."""
    from h2okv.eval.reasoning_report import common_problems, summarize

    rows = [*(_row("full", None, i, i < 2) for i in range(4)), *(_row("h2o", 64, i, i == 0) for i in range(2)),
            *(_row("h2o", 64, i, True, task="math500") for i in range(3)), _row("full", None, 7, False, task="math500")]
    kept = common_problems(rows)
    assert sorted((r["task"], r["policy"], r["id"]) for r in kept) == [
        ("gsm8k", "full", 0), ("gsm8k", "full", 1), ("gsm8k", "h2o", 0), ("gsm8k", "h2o", 1)]
    summaries = {(s["task"], s["policy"]): s for s in summarize(kept, [])}
    assert (summaries["gsm8k", "full"]["n"], summaries["gsm8k", "full"]["accuracy"]) == (2, 1.0)  # not 2 of 4
    assert summaries["gsm8k", "h2o"]["accuracy"] == 0.5 and summaries["gsm8k", "h2o"]["agreement"] == 0.5


def test_common_with_nothing_in_common_is_a_one_line_error(tmp_path, capsys):
    import json

    from h2okv.cli import main
    from h2okv.eval.reasoning import PIECE_FORMAT

    piece = tmp_path / "p.json"
    setup = {"model": "m", "task": "gsm8k", "style": "chat"}
    piece.write_text(json.dumps({"format": PIECE_FORMAT, "setup": setup, "batches": [],
                                 "rows": [_row("full", None, 0, True), _row("h2o", 64, 1, True)]}))
    assert main(["eval", "reasoning-report", str(piece), "--common"]) == 2
    err = capsys.readouterr().err
    assert "--common" in err and err.count("\n") == 1
    assert main(["eval", "reasoning-report", str(piece)]) == 0  # without it both rows are reported


@pytest.mark.parametrize("budgets, message", [("64,abc", "budget 'abc'"), ("1", "budget '1'"), ("1.5", "budget '1.5'"),
                                              ("0", "budget '0'"), (",", "--budgets is empty")])
def test_bad_budgets_are_one_line_errors(budgets, message, capsys, monkeypatch):
    import h2okv.models
    from h2okv.cli import main

    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: pytest.fail("validation comes first"))
    assert main(["eval", "reasoning", "--budgets", budgets]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_resume_refuses_another_setup(tiny_chat, tmp_path, capsys):
    from h2okv.cli import main

    piece = tmp_path / "p.json"
    args = ["eval", "reasoning", "--limit", "1", "--policies", "full", "--max-new-tokens", "3", "--json", str(piece)]
    assert main(args) == 0
    assert main([*args[:-2], "--max-new-tokens", "4", "--json", str(piece), "--resume"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_resume_at_another_batch_size_goes_on_and_each_row_keeps_its_own(tiny_chat, tmp_path):
    import json

    from h2okv.cli import main

    piece, alone = tmp_path / "p.json", tmp_path / "alone.json"
    args = ["eval", "reasoning", "--policies", "h2o", "--budgets", "12", "--max-new-tokens", "8"]
    assert main([*args, "--limit", "2", "--batch-size", "2", "--json", str(piece)]) == 0
    assert main([*args, "--limit", "4", "--batch-size", "3", "--json", str(piece), "--resume"]) == 0
    rows = json.loads(piece.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [2, 2, 3, 3]  # the fixture holds 4 problems
    assert main([*args, "--limit", "4", "--batch-size", "1", "--json", str(alone)]) == 0
    answers = [(r["id"], r["new_tokens"], r["predicted"], r["kv_slots"]) for r in rows]
    assert answers == [(r["id"], r["new_tokens"], r["predicted"], r["kv_slots"])
                       for r in json.loads(alone.read_text())["rows"]]


def test_recent_share_rows_are_their_own_line(tiny_chat, tmp_path, monkeypatch):
    """A piece of another recent share names it in each row's policy (the report draws it apart);
    its caches split the slots so; the keep-all policy's rows keep their plain name."""
    import json

    import h2okv.eval.reasoning as reasoning
    from h2okv.cli import main

    made = []
    real = reasoning.new_cache

    def recording(*args, **kwargs):
        cache = real(*args, **kwargs)
        made.append((cache.policy.name, cache.spec.heavy, cache.spec.recent))
        return cache

    monkeypatch.setattr(reasoning, "new_cache", recording)
    piece = tmp_path / "r.json"
    args = ["eval", "reasoning", "--limit", "2", "--max-new-tokens", "4", "--policies", "full,h2o", "--budgets", "20",
            "--recent-share", "0.25", "--json", str(piece)]
    assert main(args) == 0
    rows = json.loads(piece.read_text())["rows"]
    assert {r["policy"] for r in rows} == {"full", "h2o recent=0.25"}
    assert ("h2o", 15, 5) in made
    assert main([*args, "--resume"]) == 0  # resumes by the labelled rows: nothing left to run
    assert json.loads(piece.read_text())["rows"] == rows
    out, plot = tmp_path / "report.json", tmp_path / "acc.png"
    assert main(["eval", "reasoning-report", str(piece), "--json", str(out), "--plot", str(plot)]) == 0
    assert [s["policy"] for s in json.loads(out.read_text())["summaries"]] == ["full", "h2o recent=0.25"]
    assert plot.stat().st_size > 0


def test_a_piece_from_before_the_recent_share_resumes(tiny_chat, tmp_path):
    import json

    from h2okv.cli import main

    piece = tmp_path / "old.json"
    args = ["eval", "reasoning", "--limit", "2", "--max-new-tokens", "3", "--policies", "h2o", "--budgets", "16",
            "--batch-size", "1", "--json", str(piece)]
    assert main([*args[:3], "1", *args[4:]]) == 0  # one problem
    old = json.loads(piece.read_text())
    del old["setup"]["recent_share"]
    for row in old["rows"]:
        del row["recent_share"]
    piece.write_text(json.dumps(old))
    assert main([*args, "--resume"]) == 0
    rows = json.loads(piece.read_text())["rows"]
    assert [r["id"] for r in rows] == [old["rows"][0]["id"], rows[1]["id"]] and len(rows) == 2
    assert {r["policy"] for r in rows} == {"h2o"}


def test_fewshot_prompts_are_the_files_own(tiny_chat, tmp_path):
    """--prompt fewshot feeds the request file's few-shot context as plain text and cuts at its stops."""
    import json

    from h2okv.cli import main
    from h2okv.eval.reasoning import answer_text, prompt_ids

    _, tok = tiny_chat
    problem = load_problems("math500", limit=1, root=FIXTURE)[0]
    assert tok.decode(prompt_ids(tok, problem, "fewshot")) == problem.fewshot_context
    assert answer_text(tok, tok("x = 1\n\nProblem: next")["input_ids"], problem.stop) == "x = 1"
    piece = tmp_path / "few.json"
    assert main(["eval", "reasoning", "--task", "math500", "--prompt", "fewshot", "--limit", "2", "--policies", "h2o",
                 "--budgets", "32", "--max-new-tokens", "4", "--json", str(piece)]) == 0
    rows = json.loads(piece.read_text())["rows"]
    assert [r["style"] for r in rows] == ["fewshot", "fewshot"] and all(r["new_tokens"] <= 4 for r in rows)
