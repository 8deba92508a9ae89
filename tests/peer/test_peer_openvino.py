"""tools/peer/run_openvino.py without OpenVINO (it lives in .venv-peer-ov only; a fake
``openvino_genai`` stands in): our budget as OpenVINO's blocks, the float32 properties and the
eviction config each pipeline gets, the rows (they merge with ``eval longctx``'s and resume), the
reasoning piece, the one-time IR export, and the one-line errors."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from h2okv.core.budget import BudgetSpec
from h2okv.eval.longctx.report import summarize, summary_table
from h2okv.eval.longctx.rows import OPTIONAL_FIELDS, ROW_FIELDS, make_row, merge_rows
from source_imports import top_level_imports
from tool_scripts import TOOLS, load_tool

RUNNER = TOOLS / "peer" / "run_openvino.py"


@pytest.fixture(scope="module")
def runner():
    return load_tool("peer/run_openvino.py")


def exit_line(capsys, call) -> str:
    """The one stderr line of a refused call (exit status 2)."""
    with pytest.raises(SystemExit) as caught:
        call()
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1, err
    return err


def test_runner_imports_no_h2okv_and_openvino_only_inside_functions():
    imported = top_level_imports(RUNNER)
    assert "h2okv" not in imported and {"openvino", "openvino_genai", "transformers"} <= imported
    source = RUNNER.read_text()
    assert "\nimport openvino" not in source and "\nfrom transformers" not in source


@pytest.mark.parametrize("prompt_len", [37, 300, 1550, 2048, 2050, 8192])
@pytest.mark.parametrize("budget", [0.1, 0.2, 0.5])
def test_fraction_budget_is_ours_in_whole_blocks(runner, budget, prompt_len):
    """Ours keeps heavy + recent slots of the prompt (``BudgetSpec.resolve`` without the floor);
    OpenVINO keeps the nearest whole number of 32-token blocks of that total and of the recent part,
    one start block, and at least one evictable block."""
    heavy, recent = runner.our_slots(budget, prompt_len)
    assert (heavy, recent) == BudgetSpec.from_fraction(budget).resolve(prompt_len) or prompt_len * budget < 64
    sizes = runner.eviction_sizes(budget, prompt_len)
    assert all(v % 32 == 0 and v > 0 for v in sizes.values()) and sizes["start_size"] == 32
    assert sizes["max_cache_size"] > sizes["start_size"] + sizes["recent_size"]
    if heavy + recent >= 80:  # past the three-block least, within half a block of ours
        assert abs(sizes["max_cache_size"] - (heavy + recent)) <= 16
        assert abs(sizes["recent_size"] - recent) <= 16 or sizes["recent_size"] == sizes["max_cache_size"] - 64


def test_budget_examples(runner):
    # 20% of 2048: 204 + 204 = 408 tokens -> 13 blocks (416); recent 204 -> 6 blocks (192)
    assert runner.eviction_sizes(0.2, 2048) == {"max_cache_size": 416, "start_size": 32, "recent_size": 192}
    # 10% of the colleague's 1,550-token passkey: 77 + 77 = 154 -> 5 blocks; recent 77 -> 2 blocks
    assert runner.eviction_sizes(0.1, 1550) == {"max_cache_size": 160, "start_size": 32, "recent_size": 64}
    # a slot budget (reasoning): 128 = 64 heavy + 64 recent
    assert runner.eviction_sizes(128, 900) == {"max_cache_size": 128, "start_size": 32, "recent_size": 64}
    assert runner.nearest_blocks(48) == 2 and runner.nearest_blocks(47.9) == 1  # half a block rounds up
    # too small for start + recent + one evictable block: three blocks, the recent part shrinks to fit
    assert runner.eviction_sizes(0.2, 100) == {"max_cache_size": 96, "start_size": 32, "recent_size": 32}


class FakeGenai:
    """The parts of ``openvino_genai`` the runner touches; every pipeline answers ``script`` (the
    generated ids) and holds ``usage`` percent of its KV blocks at the end."""

    def __init__(self, script=(), usage=0.0):
        self.pipelines, self.script, self.usage = [], list(script), usage
        fake = self

        class SchedulerConfig:
            def __init__(self):
                self.use_cache_eviction, self.cache_eviction_config = False, None

        class Pipeline:
            def __init__(self, path, scheduler, device, properties):
                self.args = (path, scheduler, device, properties)
                self.config = SimpleNamespace(do_sample=True, max_new_tokens=0, stop_token_ids={7}, eos_token_id=7)
                self.requests = []
                fake.pipelines.append(self)

            def get_config(self):
                return self.config

            def add_request(self, request_id, ids, config):
                self.requests.append((ids.tolist(), config))
                self.pending = True
                metrics = SimpleNamespace(get_ttft=lambda: SimpleNamespace(mean=500.0),
                                          get_tpot=lambda: SimpleNamespace(mean=20.0))
                return SimpleNamespace(read_all=lambda: [SimpleNamespace(generated_ids=fake.script)],
                                       get_perf_metrics=lambda: metrics)

            def has_non_finished_requests(self):
                return self.pending

            def step(self):
                self.pending = False

            def get_metrics(self):
                return SimpleNamespace(cache_usage=fake.usage)

        self.module = SimpleNamespace(
            SchedulerConfig=SchedulerConfig, ContinuousBatchingPipeline=Pipeline,
            AggregationMode=SimpleNamespace(SUM="SUM", NORM_SUM="NORM_SUM"),
            CacheEvictionConfig=lambda **kwargs: kwargs)


@pytest.fixture
def genai(monkeypatch):
    fake = FakeGenai()
    monkeypatch.setitem(sys.modules, "openvino_genai", fake.module)
    monkeypatch.setitem(sys.modules, "openvino", SimpleNamespace(Tensor=lambda array: array))
    return fake


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{i}" for i in ids)


def test_pipelines_get_float32_and_h2o_eviction(runner, genai):
    """Every pipeline compiles with f32 compute and KV cache and the thread count; an h2o policy
    adds OpenVINO's eviction with our sizes, the whole prompt's scores (SnapKV window 0) and no
    re-rotation; ``full`` evicts nothing. A pipeline is reused while the policy and sizes hold."""
    engine = runner.Engine(Path("/ir"), WordTokenizer(), threads=1, longest=2100, bytes_per_token=100)
    sizes = runner.eviction_sizes(0.2, 2048)
    engine.pipeline("h2o-norm_sum", sizes)
    engine.pipeline("h2o-norm_sum", dict(sizes))
    engine.pipeline("full", None)
    assert len(genai.pipelines) == 2
    (path, scheduler, device, properties), full = genai.pipelines[0].args, genai.pipelines[1].args
    assert (path, device) == ("/ir", "CPU")
    assert properties == full[3] == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                     "INFERENCE_NUM_THREADS": 1}
    assert scheduler.use_cache_eviction and scheduler.cache_eviction_config == {
        "start_size": 32, "recent_size": 192, "max_cache_size": 416, "aggregation_mode": "NORM_SUM",
        "apply_rotation": False, "snapkv_window_size": 0}
    assert not scheduler.enable_prefix_caching and scheduler.max_num_seqs == 1
    assert scheduler.max_num_batched_tokens == 2100 and scheduler.num_kv_blocks * 32 >= 2100
    assert not full[1].use_cache_eviction and full[1].cache_eviction_config is None
    assert runner.f32_properties(None) == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def test_answer_is_greedy_cut_as_ours_and_timed_by_openvino(runner, genai):
    """Greedy, the exported ids fed as they are; the answer ends at the first EOS (not kept) as
    h2okv's loop ends; TTFT is the prefill, TPOT x the tokens after the first the decode; the
    cache usage gives the K/V held."""
    genai.script, genai.usage = [5, 6, 7, 8], 50.0
    engine = runner.Engine(Path("/ir"), WordTokenizer(), threads=1, longest=96, bytes_per_token=100)
    result = engine.answer("h2o-sum", runner.eviction_sizes(128, 40), list(range(40)), max_new_tokens=10)
    (ids, config), = genai.pipelines[0].requests
    assert ids == [list(range(40))] and config.do_sample is False and config.max_new_tokens == 10
    assert (result["token_ids"], result["finish"], result["text"]) == ([5, 6], "eos", "w5 w6")
    assert result["prefill_s"] == 0.5 and result["decode_s"] == pytest.approx(3 * 0.02)
    held = 0.5 * runner.kv_blocks(96) * 32  # 50% of the pipeline's blocks
    assert result["kv_slots"] == held and result["kv_bytes"] == held * 100
    assert result["kv_fraction"] == pytest.approx(held / (40 + 4))


def test_stop_strings_and_length_end_as_ours(runner):
    decode = WordTokenizer().decode
    assert runner.end_of_answer([1, 2, 3, 4], decode, {9}, ["w2"], 10) == ([1, 2], "stop")
    assert runner.end_of_answer([1, 2, 3, 4], decode, {9}, [], 3) == ([1, 2, 3], "length")
    assert runner.end_of_answer([1, 9, 3], decode, {9}, [], 3) == ([1], "eos")


def longctx_export():
    prompts = [{"task": task, "context": 2048, "sample": s, "context_ids": [1] * 50, "question_ids": [2] * 14,
                "references": [ref], "metric": "string_match_all", "max_new_tokens": 8}
               for task, ref in [("niah_single_2", "3312307"), ("vt", "ABC")] for s in (0, 1)]
    return {"format": "h2okv-longctx-prompts/1", "model": "/m", "haystack": "stories", "seed": 1, "chat": True,
            "budgets": [0.2], "decoding": "greedy", "prompts": prompts}


def fake_answer(calls: list, dies_at: int | None = None):
    def answer(policy, sizes, ids, max_new_tokens):
        if len(calls) == dies_at:
            raise KeyboardInterrupt
        calls.append((policy, sizes and sizes["max_cache_size"], len(ids), max_new_tokens))
        text = "the number is 3312307" if len(calls) % 2 else "no idea"
        return {"token_ids": [1, 2], "finish": "eos", "text": text, "prefill_s": 1.25, "decode_s": 0.5,
                "kv_slots": 96, "kv_bytes": 9600, "kv_fraction": 0.25}
    return answer


def test_longctx_rows_merge_with_ours_and_resume(runner, tmp_path):
    """Rows have ``eval longctx``'s fields (with the timings and K/V share), are scored by our
    metric, merge with our rows into one table, and an interrupted run goes on from the prompts
    it wrote: no prompt is answered twice."""
    exported, out, calls = longctx_export(), tmp_path / "ov.json", []
    with pytest.raises(KeyboardInterrupt):
        runner.run_longctx(exported, ["full", "h2o-sum"], [0.2], str(out), fake_answer(calls, dies_at=5))
    assert len(json.loads(out.read_text())) == 5
    first = list(calls)
    rows = runner.run_longctx(exported, ["full", "h2o-sum"], [0.2], str(out), fake_answer(calls))
    assert len(calls) == 8 and calls[5:] == [("h2o-sum", 96, 64, 8)] * 3 and first[:4] == [("full", None, 64, 8)] * 4
    assert rows == json.loads(out.read_text()) and len(rows) == 8
    for row in rows:
        assert tuple(row)[: len(ROW_FIELDS)] == ROW_FIELDS and set(row) - set(ROW_FIELDS) <= set(OPTIONAL_FIELDS)
        assert row == make_row(**row)  # a row of ours, field for field
        assert (row["question"], row["chunk_size"], row["prefill_s"], row["decode_s"], row["seconds"]) == (
            "aware", 64, 1.25, 0.5, 1.75)
    h2o = [r for r in rows if r["policy"] == "openvino-h2o-sum"]
    assert all(r["cache_options"] == runner.CACHE_OPTIONS and r["budget"] == 0.2 for r in h2o)
    assert {r["policy"]: r["budget"] for r in rows} == {"openvino-full": 1.0, "openvino-h2o-sum": 0.2}
    assert [r["score"] for r in rows[:4]] == [1.0, 0.0, 0.0, 0.0]  # our metric: the reference in the answer
    assert runner.run_longctx(exported, ["full", "h2o-sum"], [0.2], str(out), fake_answer(calls)) == rows
    assert len(calls) == 8  # nothing left to run

    ours = [make_row(**{**r, "policy": "h2o", "cache_options": {}}) for r in h2o]
    merged = merge_rows(ours, rows)
    label = "openvino-h2o-sum [block_size=32,recent_share=0.5,snapkv_window_size=0,start_size=32]"
    # one line per configuration: every prompt's row of one configuration has the same options
    assert sorted(s["config"] for s in summarize(merged)) == ["h2o", "openvino-full", label]
    assert label in summary_table(merged)


def test_reasoning_piece_has_kvpress_rows_and_resumes(runner, tmp_path):
    from h2okv.eval.reasoning_report import merge

    exported = {"format": "h2okv-reasoning-prompts/1", "model_path": "/m", "budgets": [128], "eos_ids": [9],
                "setup": {"model": "qwen2.5-0.5b", "task": "gsm8k", "style": "chat", "max_new_tokens": 5,
                          "batch_size": 8, "seed": 0},
                "problems": [{"id": i, "prompt_ids": list(range(200 + i)), "gold": str(i), "stop": ["Q:"]}
                             for i in range(2)]}
    calls, out = [], tmp_path / "piece.json"

    def answer(policy, sizes, ids, max_new_tokens, eos_ids, stop):
        calls.append((policy, sizes, len(ids), max_new_tokens, eos_ids, stop))
        i = len(ids) - 200
        return {"token_ids": [4] * 3, "finish": "eos", "text": f"so \\boxed{{{i}}}", "prefill_s": 1.0,
                "decode_s": 0.5, "kv_slots": 128, "kv_bytes": 1000, "kv_fraction": 0.5}

    piece = runner.run_reasoning(exported, ["h2o-sum", "full"], [128], str(out), answer)
    sizes = {"max_cache_size": 128, "start_size": 32, "recent_size": 64}
    assert calls == [("h2o-sum", sizes, 200, 5, {9}, ["Q:"]), ("h2o-sum", sizes, 201, 5, {9}, ["Q:"]),
                     ("full", None, 200, 5, {9}, ["Q:"]), ("full", None, 201, 5, {9}, ["Q:"])]
    kvpress = load_tool("peer/decoding_kvpress.py")
    for row in piece["rows"]:
        problem = exported["problems"][row["id"]]
        assert row == kvpress.reasoning_row(piece["setup"], problem, answer(row["policy"][9:], None, problem["prompt_ids"],
                                                                            5, {9}, []), row["policy"], row["budget"])
    assert [(b["policy"], b["budget"], b["decode_seconds_per_token"]) for b in piece["batches"]] == [
        ("openvino-h2o-sum", 128, 0.25)] * 2 + [("openvino-full", None, 0.25)] * 2
    assert piece["batches"][0]["openvino"] == sizes and "aggregation_mode=SUM" in piece["peer"]["openvino-h2o-sum"]
    calls.clear()
    assert runner.run_reasoning(exported, ["h2o-sum", "full"], [128], str(out), answer) == piece and calls == []
    rows, _ = merge([out])  # reasoning-report grades the text with our answers.py
    assert {(r["policy"], r["id"]): r["correct"] for r in rows} == {
        (p, i): True for p in ("openvino-h2o-sum", "openvino-full") for i in range(2)}


def test_ir_is_exported_once_and_a_failed_export_leaves_nothing(runner, tmp_path, capsys):
    model = tmp_path / "Model-transformers-5-v2"
    model.mkdir()
    (model / "config.json").write_text("{}")
    commands = []

    def optimum(command, check):
        commands.append(command)
        Path(command[-1]).mkdir()
        (Path(command[-1]) / "openvino_model.xml").write_text("<net/>")
        return SimpleNamespace(returncode=0)

    ir = runner.export_ir(model, run=optimum)
    assert ir == tmp_path / "Model-transformers-5-v2-openvino-fp32" and (ir / "openvino_model.xml").is_file()
    assert commands[0][1:] == ["export", "openvino", "--model", str(model), "--task", "text-generation-with-past",
                               "--weight-format", "fp32", commands[0][-1]]
    assert json.loads((ir / runner.MARKER).read_text())["weight_format"] == "fp32"
    assert runner.export_ir(model, run=optimum) == ir and len(commands) == 1  # cached

    other = tmp_path / "Other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    err = exit_line(capsys, lambda: runner.export_ir(other, run=lambda c, check: SimpleNamespace(returncode=1)))
    assert "optimum-cli export openvino failed (exit 1)" in err
    assert [p.name for p in tmp_path.iterdir() if "Other" in p.name] == ["Other"]


def test_missing_openvino_is_a_one_line_error(runner, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(longctx_export()))
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # import fails as where it is not installed
    err = exit_line(capsys, lambda: runner.main([str(prompts), "--budgets", "0.2", "--json", str(tmp_path / "o.json")]))
    assert "openvino-genai is not installed" in err and "make peer-openvino" in err
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("args, match", [
    (["--policies", "h2o,full"], "unknown policy h2o"),
    (["--budgets", "1.5"], "budget '1.5' is not a fraction in (0, 1]"),
    (["--limit", "0"], "--limit must be >= 1"),
])
def test_bad_arguments_are_one_line_errors(runner, tmp_path, capsys, args, match):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(longctx_export()))
    assert match in exit_line(capsys, lambda: runner.main([str(prompts), *args, "--json", str(tmp_path / "o.json")]))


def test_bad_inputs_are_one_line_errors(runner, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "h2okv-retrieval-prompts/1"}))
    assert "is not an h2okv-longctx-prompts/1" in exit_line(capsys, lambda: runner.main([str(bad), "--json", "o"]))
    reasoning = tmp_path / "r.json"
    reasoning.write_text(json.dumps({"format": "h2okv-reasoning-prompts/1", "budgets": [64]}))
    assert "budget '64' is not a slot count >= 96" in exit_line(capsys, lambda: runner.main([str(reasoning), "--json", "o"]))
    assert "one of --model DIR or --prompts FILE" in exit_line(capsys, lambda: runner.main(["export"]))


def test_speed_table_compares_each_engine_with_its_own_full():
    speed = load_tool("peer/speed_openvino.py")
    rows = [{"engine": e, "context": 1024, "policy": p, "budget": b, "prefill_s": t, "steps": 32, "decode_s": d,
             "kv_fraction": k}
            for e, p, b, t, d, k in [("h2okv", "full", 1.0, 4.0, 8.0, 1.0), ("h2okv", "h2o", 0.2, 5.0, 4.0, 0.2),
                                     ("openvino", "openvino-full", 1.0, 2.0, 3.2, 1.0),
                                     ("openvino", "openvino-h2o-sum", 0.2, 2.0, 3.2, 0.22)]]
    rows = speed.with_ratios(rows)
    assert [(r["ttft_vs_full"], r["decode_tok_s"], r["decode_vs_full"]) for r in rows] == [
        (1.0, 4.0, 1.0), (1.25, 8.0, 2.0), (1.0, 10.0, 1.0), (1.0, 10.0, 1.0)]
    assert speed.prompt_ids(64, 1000) == speed.prompt_ids(64, 1000) and max(speed.prompt_ids(64, 1000)) < 1000
    assert "openvino-h2o-sum" in speed.table(rows)
