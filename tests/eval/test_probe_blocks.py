"""tools/measure/probe_blocks.py: it times every block size asked for on the same probe call,
refuses a size whose values differ (the block only cuts the work), and leaves the module's
block sizes as it found them."""

import json
import sys

import pytest

from h2okv.core import reconstruction
from tool_scripts import load_tool


def run(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["probe_blocks.py", *argv])
    load_tool("measure/probe_blocks.py").main()


def test_every_size_is_timed_and_the_sizes_are_put_back(monkeypatch, tmp_path):
    before = reconstruction.PROBE_BLOCK_BYTES, reconstruction.CPU_PROBE_BLOCK_BYTES
    out = tmp_path / "blocks.json"
    run(monkeypatch, "--context", "40", "--probe", "12", "--heads", "4,2", "--head-dim", "8", "--mib", "1,2",
        "--repeats", "2", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["mib"] for row in rows] == [1, 2] and all(len(row["seconds"]) == 2 for row in rows)
    assert (reconstruction.PROBE_BLOCK_BYTES, reconstruction.CPU_PROBE_BLOCK_BYTES) == before


def test_a_size_that_changes_the_values_is_refused(monkeypatch):
    real = reconstruction.probe_attention
    calls = []

    def drifting(*args, **kwargs):
        out, best = real(*args, **kwargs)
        calls.append(1)
        return out + len(calls), best

    monkeypatch.setattr(reconstruction, "probe_attention", drifting)
    with pytest.raises(SystemExit, match="other values"):
        run(monkeypatch, "--context", "40", "--probe", "12", "--heads", "4,2", "--head-dim", "8", "--mib", "1,2",
            "--repeats", "1")
