"""``h2okv serve-bench`` and the ``serve`` command line, on a tiny model (the real run is in docs/results)."""

import json

import pytest

from h2okv.cli import main
from h2okv.tools.tiny_chat import tiny_chat_model


@pytest.fixture
def tiny(monkeypatch):
    """``load_model`` returns the tiny model, so the CLI runs end to end in seconds."""
    import h2okv.models

    pair = tiny_chat_model(layers=2)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *args, **kwargs: pair)
    return pair


def test_bench_compares_policies_at_the_same_kv_memory(tiny, tmp_path, capsys):
    model, _ = tiny
    from h2okv.serve.memory import bytes_per_slot, reservation

    prompt, new = 96, 32  # decode long enough, relative to the 3-chunk prefills, for batches to fill up
    full = reservation(prompt, new, None, 32)
    kv_memory = 2 * full.slots * bytes_per_slot(model)  # room for two full-cache requests
    out = tmp_path / "bench.json"
    code = main(["serve-bench", "--kv-memory", str(kv_memory), "--policies", "full,h2o", "--requests", "10",
                 "--concurrency", "10", "--prompt-tokens", str(prompt), "--max-tokens", str(new),
                 "--chunk-size", "32", "--schedules", "budget,serial", "--step-tokens", "64", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [(r["schedule"], r["policy"]) for r in result["results"]] == [
        ("budget", "full"), ("budget", "h2o"), ("serial", "full"), ("serial", "h2o")]
    for row in result["results"]:
        assert row["ok"] == row["requests"] == 10 and not row["errors"]
        assert row["completion_tokens"] == 10 * new  # ignore_eos: every request generates max_tokens
        assert row["kv_bytes_in_use_after"] == 0 and row["kv_bytes_peak"] <= kv_memory
        assert row["latency_p50_s"] <= row["latency_p95_s"]
        # a client starved of CPU reads several SSE lines at once: their gaps round to 0 at 0.1 ms, so
        # the median may be 0 on a loaded machine; the slowest gaps are the steps themselves
        assert 0 <= row["itl_p50_s"] <= row["itl_p95_s"] and row["itl_p95_s"] > 0
        assert row["queue_p50_s"] <= row["queue_p95_s"]
        assert row["engine_steps"] > 0 and 0 < row["outside_forward_share"] < 1  # the engine's time outside the model
        assert 0 < row["outside_forward_ms_p50"] <= row["outside_forward_ms_p99"]
    summary = result["summary"]
    budget_rows = [r for r in result["results"] if r["schedule"] == "budget"]
    tokens = {r["policy"]: r["tokens_per_s"] for r in budget_rows}
    assert summary["h2o_vs_full_tokens_per_s"] == round(tokens["h2o"] / tokens["full"], 3)
    assert {"full/ttft_p95_serial_over_budget", "h2o/ttft_p95_serial_over_budget"} <= set(summary)
    rows = {r["policy"]: r for r in budget_rows}
    assert rows["full"]["max_concurrent_batch"] == 2
    assert rows["h2o"]["max_concurrent_batch"] >= 3 * rows["full"]["max_concurrent_batch"]
    assert rows["h2o"]["kv_slots_per_request"] == 2 * (prompt // 10) + 1
    assert result["command"].startswith("h2okv serve-bench --profile prefill-heavy --kv-memory")
    assert "max batch" in capsys.readouterr().out


def test_quantized_slots_serve_more_sequences_in_the_same_kv_memory(tiny, tmp_path):
    """``serve-bench --kv-bits 4 --key-bits 8``: every server's slots coded, its rows labelled so; a
    request reserves the coded bytes, so the same --kv-memory runs a bigger batch."""
    from h2okv.serve.memory import bytes_per_slot, reservation

    model, _ = tiny
    prompt, new = 96, 16  # (the tiny model's 16-channel heads: a coded slot 1/4 of a float32 one)
    h2o = reservation(prompt, new, 2 * (prompt // 10), 32)  # 10% + 10% of the prompt
    kv_memory = 2 * h2o.prefill_peak * bytes_per_slot(model)  # two float h2o prefills at once
    common = ["serve-bench", "--kv-memory", str(kv_memory), "--policies", "h2o", "--requests", "16",
              "--concurrency", "16", "--prompt-tokens", str(prompt), "--max-tokens", str(new), "--chunk-size", "32"]
    runs = {}
    for name, coding in (("float", []), ("coded", ["--kv-bits", "4", "--key-bits", "8"])):
        out = tmp_path / f"{name}.json"
        assert main([*common, *coding, "--json", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    float_row, coded_row = runs["float"]["results"][0], runs["coded"]["results"][0]
    assert (float_row["policy"], coded_row["policy"]) == ("h2o", "h2o k8v4")
    assert coded_row["ok"] == 16 and coded_row["kv_bytes_peak"] <= kv_memory
    assert runs["coded"]["config"]["coding"] == {"kv_bits": 4, "kv_group": 32, "key_bits": 8}
    assert "--kv-bits 4 --key-bits 8" in runs["coded"]["command"]
    coded_slot = bytes_per_slot(model, kv_bits=4, key_bits=8, kv_group=32)
    assert coded_row["kv_bytes_per_request"] == coded_row["kv_slots_per_request"] * coded_slot
    assert float_row["ok"] == 16 and float_row["max_concurrent_batch"] >= 2
    assert coded_row["max_concurrent_batch"] >= 1.8 * float_row["max_concurrent_batch"]


def test_every_evicting_policy_is_compared_with_full_in_the_same_run():
    from h2okv.bench.serve import ratios

    def row(policy, tokens, correct):
        return {"schedule": "budget", "policy": policy, "tokens_per_s": tokens, "itl_p95_s": 1.0 / tokens,
                "ttft_p95_s": 1.0, "accuracy": correct / 32, "accuracy_stderr": 0.07 if policy == "full" else 0.05}

    summary = ratios([row("full", 5.0, 7), row("h2o", 17.0, 2), row("rkv:weight=0.3", 16.0, 6)])
    assert summary["h2o_vs_full_tokens_per_s"] == 3.4 and summary["rkv:weight=0.3_vs_full_tokens_per_s"] == 3.2
    assert summary["budget/full_vs_rkv:weight=0.3_itl_p95"] == 3.2
    assert summary["budget/rkv:weight=0.3_minus_full_accuracy_in_stderr"] == round(-1 / 32 / 0.07, 3)
    assert "full_vs_full_tokens_per_s" not in summary


def test_poisson_arrivals_and_profiles():
    from h2okv.bench.serve import PROFILES, apply_profile, poisson_arrivals
    from h2okv.cli.serve import register  # noqa: F401 - the profiles live with the bench

    times = poisson_arrivals(2000, rate=4.0, seed=1)
    assert times[0] == 0 and times == sorted(times) and times == poisson_arrivals(2000, 4.0, seed=1)
    assert abs(times[-1] / 1999 - 0.25) < 0.03  # mean gap 1/rate

    class Args:
        profile, kv_memory, requests, concurrency, prompt_tokens, max_tokens = "decode-heavy", "64M", None, 4, None, None
        heavy = recent = heavy_ratio = recent_ratio = None

    args = Args()
    apply_profile(args)
    assert (args.kv_memory, args.concurrency, args.max_tokens, args.heavy) == ("64M", 4, 1024, 64)
    args = Args()
    args.heavy_ratio = 0.2
    apply_profile(args)
    assert args.heavy is None and args.recent is None  # the profile's budget does not mix with a given one
    assert PROFILES["prefill-heavy"]["prompt_tokens"] == 256


@pytest.mark.parametrize("argv", [
    ["serve-bench", "--kv-memory", "0"],
    ["serve-bench", "--kv-memory", "lots"],
    ["serve-bench", "--kv-memory", "1M", "--policies", "h2o", "--heavy", "0", "--recent", "2"],
    ["serve-bench", "--kv-memory", "1M", "--policies", "full,nope"],
    ["serve-bench", "--kv-memory", "1M", "--schedules", "fifo"],
    ["serve-bench", "--kv-memory", "1M", "--arrival-rate", "0"],
    ["serve", "--request-timeout", "-1"],
    ["serve", "--schedule", "fast"],
    ["serve", "--api-key", " "],
    ["serve", "--policy", "full", "--heavy", "3"],
    ["serve", "--kv-memory", "-5"],
    ["serve", "--port", "70000"],
])
def test_bad_arguments_exit_2_before_loading(argv, capsys, monkeypatch):
    import h2okv.models

    def no_load(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("validation must happen before the model load")

    monkeypatch.setattr(h2okv.models, "load_model", no_load)
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("h2okv: error:")


def test_drive_with_poisson_arrivals(tiny):
    """Open-loop arrivals: every stream is well formed and the run lasts at least until the last arrival."""
    import asyncio

    from h2okv.bench.serve import drive, poisson_arrivals
    from h2okv.serve import create_app, running_server
    from h2okv.serve.engine import EngineOptions

    model, tok = tiny
    arrivals = poisson_arrivals(6, rate=10.0, seed=3)
    payloads = [{"model": "t", "prompt": [65 + i] * 8, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
                for i in range(6)]
    with running_server(create_app(model, tok, model_name="t", options=EngineOptions(prefill_chunk=16))) as url:
        report = asyncio.run(drive(url, payloads, concurrency=6, arrivals=arrivals))
    assert report.summary["ok"] == 6 and report.summary["completion_tokens"] == 24
    assert report.wall_s >= arrivals[-1] > 0


def test_gsm8k_profile_grades_the_served_answers(tiny, tmp_path, monkeypatch):
    """The reasoning profile sends the fixture's GSM8K problems as chat prompts and grades every answer."""
    from pathlib import Path

    monkeypatch.setenv("H2OKV_OE_EVAL_TASKS", str(Path(__file__).resolve().parents[1] / "support" / "fixtures" / "oe_eval_tasks"))
    out = tmp_path / "gsm8k.json"
    code = main(["serve-bench", "--profile", "gsm8k", "--requests", "3", "--max-tokens", "5", "--heavy", "16",
                 "--recent", "16", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["config"]["task"] == "gsm8k" and result["config"]["max_tokens"] == 5
    for row in result["results"]:
        assert row["ok"] == row["graded"] == 3 and 0 <= row["correct"] <= 3
        assert row["accuracy"] == round(row["correct"] / 3, 4)
    assert result["command"].startswith("h2okv serve-bench --profile gsm8k")
    assert "--prompt-tokens" not in result["command"]


def test_an_unknown_recipe_is_refused_before_the_model_loads(capsys, monkeypatch):
    import h2okv.models
    from h2okv.cli import main

    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: pytest.fail("refused before loading"))
    assert main(["serve-bench", "--profile", "chat", "--recipe", "document,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'nope'" in err and err.count("\n") == 1
