"""Tensor parallelism on CPU with gloo: 2 ranks give the same tokens, logits and budgets as one
process; bad settings and failing ranks end in one line, never a hang.

Starting ranks costs seconds (each imports torch and transformers), so the equivalence checks of
all models and commands, and the checks of the command channel ``serve --tp`` drives its ranks
with, are computed by the session's one 2-rank group (``tp_group``, tests/support/tp_group.py), which then
serves tests/serve/test_tp.py.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch

from h2okv import cli
from h2okv.errors import H2OError
from h2okv.models import load_model
from h2okv.parallel import launch
from h2okv.parallel import ranks as tp_ranks
from h2okv.tools.tiny import tiny_model
from tp_group import HEAVY, MODELS, PROMPT, RECENT, ROLL_WINDOW, generate_command, generate_rolling
from tp_group import generate_tokens as _generate
from tp_rank_bodies import fail_on_rank_1, hang_on_rank_1


@pytest.fixture(scope="module")
def tp_dirs(tp_group):
    return tp_group.dirs


def _seconds_since_waiting(directory) -> float:
    return time.time() - float((directory / "waiting_since").read_text())


# -- equivalence -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_session(tp_group):
    """What the session's group computed (tests/support/tp_group.py), and the commands it ran."""
    return tp_group.results(), tp_group.out, tp_group.commands


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "h2o"])
@pytest.mark.parametrize("arch, kv", MODELS)
def test_tp_generate_equals_single_process(tp_session, tp_dirs, arch, kv, policy):
    results = tp_session[0]
    tp_tokens, tp_logits, tp_stats = results[((arch, kv), policy)]
    model, _ = load_model(tp_dirs[(arch, kv)], cache=False)
    tokens, logits, stats = _generate(model, policy)
    assert tp_tokens == tokens
    torch.testing.assert_close(tp_logits, logits, rtol=1e-4, atol=1e-4)
    # each rank holds half the KV heads: half the bytes, the same slots per head
    per_rank = tp_stats["per_rank"]
    assert tp_stats["world_size"] == 2 and len(per_rank) == 2
    for rank_stats in per_rank:
        assert rank_stats["kv_bytes"] * 2 == stats["kv_bytes"]
        assert rank_stats["slots"] == stats["slots"]
        if policy == "h2o":
            assert rank_stats["slots"] == [HEAVY + RECENT] * len(stats["slots"])
            assert rank_stats["budget"] == [HEAVY + RECENT]
    assert tp_stats["kv_bytes"] == stats["kv_bytes"]
    assert tp_stats["full_kv_bytes"] == stats["full_kv_bytes"]


@pytest.mark.slow
def test_tp_rolling_positions_equal_single_process_past_the_window(tp_session, tp_group):
    """Each rank re-rotates its own KV heads by the same offsets: 2 ranks generate the same tokens
    as one process to 2.5x the model's window, with every position the model sees inside it."""
    tp_tokens, tp_logits, tp_largest = tp_session[0]["rolling"]
    model, _ = load_model(str(tp_group.rolling_dir), cache=False)
    tokens, logits, largest = generate_rolling(model)
    assert len(tokens) == logits.shape[0] and PROMPT + len(tokens) > 2 * ROLL_WINDOW
    assert tp_largest == largest and largest < ROLL_WINDOW
    assert tp_tokens == tokens
    torch.testing.assert_close(tp_logits, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_tp_eval_ppl_equals_single_process(tp_session, capsys):
    _, out, commands = tp_session
    single = out / "ppl_tp1.json"
    argv = [a if a != str(out / "ppl_tp2.json") else str(single) for a in commands["ppl"]]
    assert cli.main(argv) == 0
    capsys.readouterr()
    tp_rows, rows = json.loads((out / "ppl_tp2.json").read_text()), json.loads(single.read_text())
    assert [(r["policy"], r["slots"]) for r in tp_rows] == [(r["policy"], r["slots"]) for r in rows]
    for tp_row, row in zip(tp_rows, rows):
        assert tp_row["ppl"] == pytest.approx(row["ppl"], rel=1e-4)


@pytest.mark.slow
def test_tp_bench_reports_half_the_kv_per_rank(tp_session):
    _, out, _ = tp_session
    result = json.loads((out / "bench_tp2.json").read_text())
    assert result["tp"] == 2
    assert {r["policy"] for r in result["rows"]} == {"full", "h2o"}
    for row in result["rows"]:
        assert len(row["kv_bytes_per_rank"]) == 2
        assert all(b * 2 == row["tp1_kv_bytes"] for b in row["kv_bytes_per_rank"])
        assert row["same_tokens_as_tp1"] is True
        assert row["decode_step_ms"] > 0 and row["tp1_decode_step_ms"] > 0
    assert (out / "bench_tp2.md").read_text().count("| 32 | 2 |") == 2


# -- the command line, as users run it --------------------------------------------------------------
@pytest.fixture(scope="module")
def generate_argv(tp_dirs):
    """A `generate` command line on a tiny model, and what one process prints for it."""
    argv = generate_command(tp_dirs)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert cli.main(argv) == 0
    return argv, out.getvalue().strip().splitlines()


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def _check_tp2_output(out: str, single: list[str]) -> None:
    lines = out.strip().splitlines()
    assert len(lines) == 2  # rank 0 alone printed: the text and the memory line
    assert lines[0] == single[0]
    assert "2 tensor-parallel ranks hold" in lines[1]
    assert lines[1].split(";")[0] == single[1]  # same totals: tokens seen, slots, KV bytes


@pytest.mark.slow
def test_generate_tp2_prints_the_tp1_text_once(tp_session, generate_argv):
    """`generate --tp 2` run inside the session's ranks: rank 0 prints the single-process text and
    rank 1 prints nothing (a rank the launcher starts also has its output sent to /dev/null; the
    torchrun test below reads a real terminal's view)."""
    printed = tp_session[0]["generate_printed"]
    assert printed[1] == ""
    _check_tp2_output(printed[0], generate_argv[1])


@pytest.mark.slow
def test_serve_channel_replays_rank0_calls_in_order(tp_session):
    leader, follower = tp_session[0]["channel"]
    assert leader["doubled"] == 42  # rank 0 gets its own call's result
    calls = [("open", 1, 10), ("work", 21), ("fail_everywhere",), ("open", 2, 5), ("fail_on_followers",)]
    assert leader["calls"] == follower["calls"] == calls  # same calls, same order
    kinds = follower["kinds"]
    assert kinds.count("ping") >= 2 and kinds.index("call") > kinds.index("ping")  # idle rank 0 kept the group alive
    # one message per call (the kv_bytes read stayed on rank 0), the stats gather, the stop
    assert [k for k in kinds if k != "ping"] == ["call", "call", "call", "call", "stats", "call", "stop"]
    # per-rank figures, gathered between two calls
    for rank, figures in enumerate(leader["figures"]):
        assert figures == {"rank": rank, "kv_bytes": 15, "kv_bytes_peak": 15, "sequences": 2, "saved_entries": 0,
                           "saved_bytes": 0, "saved_checksum": 0}  # (no prefix store: CRC-32 of nothing)
    # the same failure on every rank is survived; one rank failing alone is a divergence
    assert follower["error"] == ("rank 1 diverged from rank 0: call fail_on_followers() failed here but "
                                 "succeeded on rank 0")


@pytest.mark.slow
def test_generate_under_torchrun_joins_the_launch(generate_argv):
    argv, single = generate_argv
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "h2okv.cli", *argv], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    _check_tp2_output(proc.stdout, single)


# -- failures: one line, every rank ended, no hang --------------------------------------------------
@pytest.mark.slow
def test_failing_rank_ends_every_rank_with_one_line(tmp_path):
    with pytest.raises(H2OError) as info:
        launch.run(Namespace(tp=2, tp_timeout=600, device="cpu", dir=str(tmp_path)), fail_on_rank_1)
    assert _seconds_since_waiting(tmp_path) < 60  # far less than the 600 s rank 0 would wait on its own
    assert str(info.value) == "rank 1 of 2 failed: rank one cannot go on"
    for rank in (0, 1):
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_stuck_rank_times_out_instead_of_hanging(tmp_path, capsys):
    # 3 s bounds the collective only: the rendezvous has launch.RENDEZVOUS_MIN_S, so a rank that
    # starts late on a loaded machine does not fail the run before rank 1 is stuck
    code = launch.run(Namespace(tp=2, tp_timeout=3, device="cpu", dir=str(tmp_path)), hang_on_rank_1)
    assert _seconds_since_waiting(tmp_path) < 60  # the 3 s timeout, not rank 1's 600 s sleep
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("h2okv: error: rank 0 of 2 failed:")
    assert "--tp-timeout 3 s" in err[0]


def test_short_tp_timeout_bounds_the_collectives_not_the_rendezvous(monkeypatch):
    """A one-rank group built as the ranks build theirs: its store (which the ranks meet at) waits
    RENDEZVOUS_MIN_S, its collectives --tp-timeout."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from h2okv.parallel.ranks import RankInfo

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launch._free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")  # _init_group sets them: recorded here, so the test's end unsets them
    launch._init_group(RankInfo(0, 1, 0), "cpu", 3.0)
    try:
        backend = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 3.0
        assert distributed_c10d._get_default_store().timeout.total_seconds() == launch.RENDEZVOUS_MIN_S
    finally:
        dist.destroy_process_group()


def _config_dir(tmp_path, arch, **overrides):
    model = tiny_model(arch, **overrides)
    model.config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    "case, argv, fragment",
    [
        ("kv3", ["generate", "--prompt", "w3 w4", "--tp", "2"], "has 3 KV heads, which do not divide by 2"),
        ("opt", ["generate", "--prompt", "w3 w4", "--tp", "2"], "has no tensor-parallel plan"),
        ("kv3", ["eval", "ppl", "--tp", "2", "--plot", ""], "has 3 KV heads"),
        ("kv3", ["bench", "--tp", "2", "--json", "x.json", "--quick"], "has 3 KV heads"),
        ("tiny", ["bench", "--model", "tiny:llama", "--tp", "2", "--json", "x.json"], "tiny:ARCH models"),
        ("kv3", ["generate", "--prompt", "w3", "--tp", "0"], "must be a positive integer (> 0)"),
        ("kv3", ["serve", "--tp", "2"], "has 3 KV heads, which do not divide by 2"),
        ("kv3", ["generate", "--prompt", "w3", "--tp", "2", "--tp-timeout", "-1"], "positive number of seconds"),
    ],
)
def test_bad_tp_settings_one_line_exit_2(tmp_path, capsys, case, argv, fragment):
    if case == "kv3":
        model = _config_dir(tmp_path, "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    elif case == "opt":
        model = _config_dir(tmp_path, "opt")
    if case != "tiny":
        argv = [*argv, "--model", model]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_default_model_refuses_tp2_by_its_kv_heads(capsys):
    """SmolLM2-135M has 3 KV heads (9 query heads): --tp 2 cannot give each rank whole heads."""
    assert cli.main(["generate", "--prompt", "hello", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("h2okv: error: --tp 2: the default model (SmolLM2-135M-Instruct) has 3 KV heads, which do not "
                   "divide by 2 (each rank holds whole heads); use --tp 1, 3")


def test_under_torchrun_tp_must_match_the_world_size(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert tp_ranks.resolve_tp(None) == 2
    assert cli.main(["generate", "--prompt", "w3", "--tp", "4"]) == 2
    assert "torchrun started 2 process(es)" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # the same error on another rank: printed by rank 0 only
    assert cli.main(["generate", "--prompt", "w3", "--tp", "4"]) == 2
    assert capsys.readouterr().err == ""


# -- CPU ranks on a machine with GPUs ---------------------------------------------------------------
def test_cpu_rank_under_torchrun_hides_the_gpus(monkeypatch):
    """transformers binds a tensor-parallel rank to cuda:<LOCAL_RANK> whenever it sees a GPU; a CPU
    rank hides them first (the lent H100's rank 1: "invalid device ordinal")."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: os.environ.get("CUDA_VISIBLE_DEVICES") != "")
    launch.hide_gpus_from_cpu_rank()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_cpu_rank_that_still_sees_a_gpu_is_a_one_line_error(monkeypatch):
    """Once CUDA has counted its devices the hiding cannot take effect: say what to do instead of
    letting transformers fail on the second GPU that is not there."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(H2OError, match="CUDA_VISIBLE_DEVICES= ") as info:
        launch.hide_gpus_from_cpu_rank()
    assert len(str(info.value).splitlines()) == 1
