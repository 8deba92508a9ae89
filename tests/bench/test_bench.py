"""``h2okv bench`` on tiny random models: the result's shape and bookkeeping, never its speed."""

import json
import math

import pytest
import torch

from h2okv.bench import BenchConfig, run_bench
from h2okv.bench.memory import cache_kv_bytes, kv_bytes_per_token, measure_peak
from h2okv.bench.report import check_targets, growth_exponent, markdown
from h2okv.cli import main
from h2okv.core.compat import cache_arg
from h2okv.tools.tiny import tiny_model

ROW_KEYS = {
    "policy", "batch", "context", "budget", "prefill_s", "decode_step_ms", "decode_tokens_per_s",
    "kv_bytes", "peak_mem_bytes", "kept_tokens",
}
RATIOS = (
    "h2o_vs_full_throughput", "h2o_vs_reference_step", "h2o_vs_reference_step_cpu", "h2o_vs_full_kv_bytes",
    "h2o_vs_full_prefill",
)


@pytest.fixture(scope="module")
def tiny_result():
    model = tiny_model("llama")
    cfg = BenchConfig(
        batches=[1, 3], contexts=[40, 80], budget=0.2, steps=3, warmup=1, rounds=2,
        memory_contexts=[20, 40], memory_cap=64 * 1024, cap_steps=2, chunk_size=16,
        memory_isolation="inprocess",
    )
    return model, cfg, run_bench(model, None, cfg, progress=False)


def test_rows_and_ratios_present_and_positive(tiny_result):
    _, cfg, result = tiny_result
    rows = result["rows"]
    assert {(r["policy"], r["batch"], r["context"]) for r in rows} == {
        (p, b, c) for p in ("full", "h2o", "reference") for b in cfg.batches for c in cfg.contexts
    }
    for r in rows:
        assert ROW_KEYS <= r.keys()
        for key in ("prefill_s", "decode_step_ms", "decode_step_cpu_ms", "decode_tokens_per_s", "kv_bytes"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (key, r)
        assert r["steps"] == cfg.steps
        assert math.isclose(r["decode_tokens_per_s"], r["batch"] * 1000 / r["decode_step_ms"])
    summary = result["summary"]["rows"]
    assert len(summary) == len(cfg.batches) * len(cfg.contexts)
    for s in summary:
        for key in RATIOS:
            assert isinstance(s[key], float) and s[key] > 0 and math.isfinite(s[key]), (key, s)
    json.dumps(result)  # the whole result is JSON-serialisable


def test_h2o_keeps_its_budget_and_reference_matches_it(tiny_result):
    model, cfg, result = tiny_result
    per_token = kv_bytes_per_token(model, torch.float32)
    by = {(r["policy"], r["batch"], r["context"]): r for r in result["rows"]}
    for c in cfg.contexts:
        budget = 2 * int(cfg.budget / 2 * c)
        for b in cfg.batches:
            h2o, full, ref = by[("h2o", b, c)], by[("full", b, c)], by[("reference", b, c)]
            assert h2o["kept_tokens"] == ref["kept_tokens"] == budget
            # H2O: budget + 1 slots per row; full: the prompt and every generated token
            assert h2o["kv_bytes"] == b * (budget + 1) * per_token
            assert full["kv_bytes"] == b * (c + cfg.warmup + cfg.steps) * per_token
            # the reference is cropped back to the budget before each step, then gains one token
            assert ref["kv_bytes"] == b * (budget + 1) * per_token


def test_memory_cap_batches_follow_from_per_token_bytes(tiny_result):
    model, cfg, result = tiny_result
    cap = result["memory_cap"]
    per_token = kv_bytes_per_token(model, torch.float32)
    context = max(cfg.contexts)
    assert cap["context"] == context
    assert cap["max_batch"]["full"] == cfg.memory_cap // ((context + cfg.warmup + cfg.cap_steps) * per_token)
    assert cap["max_batch"]["h2o"] == cfg.memory_cap // ((2 * int(cfg.budget / 2 * context) + 1) * per_token)
    for policy in ("full", "h2o"):
        measured = cap["measured"][policy]
        assert measured["batch"] == cap["max_batch"][policy]
        assert measured["fits"] and measured["kv_bytes"] <= cfg.memory_cap
    assert cap["h2o_vs_full_batch"] == cap["max_batch"]["h2o"] / cap["max_batch"]["full"]


def test_prefill_memory_curve_and_targets(tiny_result):
    _, cfg, result = tiny_result
    contexts = {r["context"] for r in result["prefill"]}
    assert set(cfg.memory_contexts) | set(cfg.contexts) <= contexts
    assert all(r["peak_mem_bytes"] >= 0 and r["prefill_s"] > 0 for r in result["prefill"])
    names = {t["name"] for t in result["targets"]}
    assert {"h2o_vs_reference_step", "h2o_vs_full_kv_bytes", "cap_h2o_vs_full_batch"} <= names
    for t in result["targets"]:
        assert t["met"] == (t["value"] <= t["threshold"] if t["op"] == "<=" else t["value"] >= t["threshold"])
    text = markdown(result)
    assert "| policy | batch | context |" in text and "h2o/reference step" in text


def test_kv_bytes_of_dynamic_and_h2o_caches():
    from transformers import DynamicCache

    from h2okv import H2OCache

    model = tiny_model("llama")
    ids = torch.randint(2, 90, (2, 30))
    per_token = kv_bytes_per_token(model, torch.float32)
    dyn = DynamicCache(config=model.config)
    model(ids, **cache_arg(dyn))
    assert cache_kv_bytes(dyn) == 2 * 30 * per_token
    h2o = H2OCache(model, policy="h2o", heavy=4, recent=4)
    model(ids, **cache_arg(h2o))
    assert cache_kv_bytes(h2o) == 2 * 9 * per_token  # budget + 1 slots after the prefill


def test_measure_peak_sees_a_known_allocation():
    with measure_peak("cpu") as mem:
        block = torch.ones(16 * 1024 * 1024)  # 64 MiB, touched
        del block
    assert mem.peak_bytes >= 0.9 * 64 * 2**20
    assert mem.method.startswith("rss")


def test_growth_exponent_tells_linear_from_quadratic():
    assert growth_exponent([(n, 5 * n) for n in (1024, 2048, 4096)]) == pytest.approx(1.0)
    assert growth_exponent([(n, n * n) for n in (1024, 2048, 4096)]) == pytest.approx(2.0)
    assert growth_exponent([(1024, 10)]) is None


def test_targets_judge_the_worst_row():
    rows = [
        {"batch": 1, "context": 64, "h2o_vs_full_throughput": 1.1, "h2o_vs_reference_step": 1.05,
         "h2o_vs_full_kv_bytes": 0.2, "h2o_vs_full_prefill": 1.0},
        {"batch": 8, "context": 64, "h2o_vs_full_throughput": 2.5, "h2o_vs_reference_step": 1.2,
         "h2o_vs_full_kv_bytes": 0.19, "h2o_vs_full_prefill": 1.0},
    ]
    targets = {t["name"]: t for t in check_targets({"summary": {"rows": rows, "prefill": []}})}
    assert targets["h2o_vs_reference_step"]["value"] == 1.2 and not targets["h2o_vs_reference_step"]["met"]
    assert targets["h2o_vs_full_throughput"]["value"] == 2.5 and targets["h2o_vs_full_throughput"]["met"]
    assert targets["h2o_vs_full_kv_bytes"]["met"]
    assert "h2o_vs_full_prefill" not in targets  # no prefill rows: not judged


def test_cli_writes_json_markdown_and_plots(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--model", "tiny:llama", "--batch", "1,2", "--context", "24,48", "--memory-contexts", "24",
        "--steps", "2", "--rounds", "1", "--warmup", "1", "--chunk-size", "8", "--no-progress",
        "--json", str(out), "--plot-dir", str(tmp_path / "figs"),
    ])
    assert code == 0
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 3 * 2 * 2
    # the default measures prefill memory in a fresh process
    assert all(r["peak_mem_method"].endswith("fresh_process") for r in result["prefill"])
    assert (tmp_path / "bench.md").read_text().startswith("Model ")
    for name in ("bench_throughput.png", "bench_kv_memory.png", "bench_prefill.png"):
        assert (tmp_path / "figs" / name).stat().st_size > 1000
    assert "h2o/full tokens/s" in capsys.readouterr().out


def test_cli_without_json_prints_the_report_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """`h2okv bench` with no --json (as `bench --quick` is first tried): the report on stdout, no files."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--model", "tiny:llama", "--batch", "1", "--context", "24", "--memory-contexts", "24",
                 "--steps", "2", "--rounds", "1", "--warmup", "1", "--chunk-size", "8", "--no-progress",
                 "--memory-isolation", "inprocess", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "h2o/full tokens/s" in out and "| target | what it checks |" in out and "wrote" not in out
    assert list(tmp_path.iterdir()) == []


def test_targets_table_explains_each_target_and_a_miss():
    met = {"name": "h2o_vs_full_kv_bytes", "what": "H2O / full KV bytes, every row", "value": 0.2,
           "threshold": 0.21, "op": "<=", "met": True, "where": "worst row"}
    missed = {**met, "name": "h2o_vs_full_throughput", "what": "H2O / full decode tokens/s", "value": 1.1,
              "threshold": 2.0, "op": ">=", "met": False}
    from h2okv.bench.report import _targets_table

    text = "\n".join(_targets_table([met, missed], longest_context=512))
    assert "| h2o_vs_full_throughput | H2O / full decode tokens/s | 1.100 | >= 2.0 | NO |" in text
    assert "NO = missed on this run" in text and "longest prompt is 512 tokens" in text
    # every target met: no note on misses; a run at the default grid's lengths: no smoke-test note
    assert "NO = missed" not in "\n".join(_targets_table([met], longest_context=512))
    assert "smoke test" not in "\n".join(_targets_table([met, missed], longest_context=4096))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "1.5", "--json", "x.json"], "--budget must be in (0, 1)"),
        (["--model", "tiny:nope", "--json", "x.json"], "unknown tiny architecture"),
    ],
)
def test_bad_settings_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("argv", [["--batch", "0,8"], ["--context", "x"], ["--memory-cap", "lots"]])
def test_bad_grid_values_exit_2(argv, capsys):
    assert main(["bench", *argv, "--json", "x.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error:") and "\n" not in err


@pytest.mark.integration
def test_quick_bench_on_default_model(tmp_path):
    """`h2okv bench --quick` as a user runs it: the JSON carries every promised key (not speed)."""
    out = tmp_path / "quick.json"
    assert main(["bench", "--quick", "--no-progress", "--json", str(out), "--plot-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    keys = {"policy", "batch", "context", "budget", "prefill_s", "decode_step_ms", "decode_tokens_per_s",
            "kv_bytes", "peak_mem_bytes"}
    assert {r["policy"] for r in result["rows"]} == {"full", "h2o", "reference"}
    for row in result["rows"]:
        assert keys <= row.keys()
        assert row["decode_tokens_per_s"] > 0 and row["kv_bytes"] > 0
    summary = json.dumps(result)
    for ratio in ("h2o_vs_full_throughput", "h2o_vs_reference_step", "h2o_vs_full_kv_bytes", "h2o_vs_full_prefill"):
        assert ratio in summary


def test_policy_study_on_a_tiny_model(tmp_path, capsys):
    """bench --policies: every policy's decode step against the same-size reference, and per-token
    scoring against a plain forward, all timed in one run."""
    out = tmp_path / "p.json"
    assert main(["bench", "--model", "tiny:llama", "--policies", "h2o,tova,snapkv:8", "--context", "64",
                 "--steps", "3", "--scoring-tokens", "48", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["decode"]) == {"h2o", "tova", "snapkv:8", "reference"}
    assert set(result["scoring"]) == {"plain", "h2o", "tova", "snapkv:8"}
    assert result["decode"]["reference"]["vs_reference_step"] == 1.0
    assert all(r["kept_tokens"] == 12 for r in result["decode"].values())  # 20% of 64, as the reference
    assert result["scoring"]["plain"]["vs_plain_forward"] == result["scoring"]["plain"]["vs_plain_forward_cpu"] == 1.0
    assert all(r["seconds"] > 0 for r in result["scoring"].values())
    assert "/ reference step" in out.with_suffix(".md").read_text()
    assert main(["bench", "--model", "tiny:llama", "--policies", "h2o,nope", "--json", str(out)]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_policy_study_with_quantized_slots(tmp_path, capsys):
    """bench --policies --kv-bits: the studied caches keep quantized slots (the reference stays plain)."""
    out = tmp_path / "q.json"
    assert main(["bench", "--model", "tiny:llama", "--policies", "h2o", "--kv-bits", "4", "--key-bits", "8",
                 "--kv-group", "8", "--context", "64", "--steps", "2", "--scoring-tokens", "32", "--no-progress",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {k: result["shape"][k] for k in ("kv_bits", "key_bits", "kv_group")} == {"kv_bits": 4, "key_bits": 8,
                                                                                    "kv_group": 8}
    assert result["decode"]["h2o"]["kept_tokens"] == 12
    assert main(["bench", "--model", "tiny:llama", "--recipes", "bounded", "--kv-bits", "4"]) == 2
    assert "--kv-bits shape the caches of the --policies study only" in capsys.readouterr().err


def test_kernel_study_on_a_tiny_model(tmp_path, capsys):
    """bench --kernels: each path's decode step against the same-size reference and per-token
    scoring against a plain forward, in one run; a path that cannot run here is reported, not run."""
    from h2okv.core.kernels import unavailable_reason

    out = tmp_path / "k.json"
    assert main(["bench", "--model", "tiny:llama", "--kernels", "eager,native,triton", "--context", "64",
                 "--batch", "1,2", "--steps", "3", "--scoring-tokens", "48", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    cpu = torch.device("cpu")
    expected = ["eager"] + [k for k in ("native", "triton") if unavailable_reason(k, cpu) is None]
    assert result["unavailable"]["triton"] == "triton kernels need a CUDA device"
    paths = {f"h2o/{k}" for k in expected}
    assert {r["path"] for r in result["decode"]} == paths | {"reference"}
    assert {(r["context"], r["batch"]) for r in result["decode"]} == {(64, 1), (64, 2)}
    assert all(r["kept_tokens"] == 12 for r in result["decode"])
    assert all(r["vs_reference_step"] == 1.0 for r in result["decode"] if r["path"] == "reference")
    assert set(result["scoring"]) == paths | {"plain"}
    assert "unavailable here" in out.with_suffix(".md").read_text()
    assert main(["bench", "--model", "tiny:llama", "--kernels", "eager,fast", "--json", str(out)]) == 2
    assert "unknown kernels 'fast'" in capsys.readouterr().err


def test_profile_step_tool_on_a_tiny_model(tmp_path):
    """python -m h2okv.tools.profile_step: per-layer groups of a decode step, both paths, and scoring."""
    from h2okv.tools.profile_step import main as profile

    out = tmp_path / "p.json"
    assert profile(["--model", "tiny:llama", "--batch", "1", "--context", "64", "--steps", "2",
                    "--scoring-tokens", "48", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    decode = result["decode"]["1"]
    assert decode["h2o"]["groups"]["attention call (h2o)"]["calls_per_step"] == 2  # one per layer
    assert decode["reference"]["groups"]["attention call (sdpa)"]["calls_per_step"] == 2
    assert result["scoring"]["h2o"]["cpu_median_s"] > 0 and result["scoring"]["plain"]["cpu_median_s"] > 0


def test_compiled_column_beside_eager_in_the_same_run():
    """``bench --compile``: h2o and reference also step through torch.compile (here the "eager"
    backend: dynamo's graphs run as they are), their rows carry the compiled numbers and the
    summary the compiled h2o/reference ratio; full is not compiled."""
    model = tiny_model("llama")
    cfg = BenchConfig(batches=[2], contexts=[60], budget=0.2, steps=3, warmup=2, memory_contexts=[20],
                      chunk_size=16, memory_isolation="inprocess", compile="eager")
    result = run_bench(model, None, cfg, progress=False)
    torch._dynamo.reset()
    by = {r["policy"]: r for r in result["rows"]}
    for policy in ("h2o", "reference"):
        assert by[policy]["compiled_decode_step_ms"] > 0 and by[policy]["compiled_decode_tokens_per_s"] > 0
    assert "compiled_decode_step_ms" not in by["full"]
    (summary,) = result["summary"]["rows"]
    assert math.isclose(summary["h2o_vs_reference_step_compiled"],
                        by["h2o"]["compiled_decode_step_ms"] / by["reference"]["compiled_decode_step_ms"])
    assert "Compiled (`--compile eager`)" in markdown(result)
