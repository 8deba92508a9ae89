"""The soak run, short (``make soak`` runs it for 10 minutes with 64 clients): a real server process
under mixed valid, abandoned, edge and malformed traffic, a quarter of the clients holding multi-turn
conversations over shared documents with the prefix store on (1 MiB: it fills and evicts), ends with
no failures, no 5xx, no KV memory held, store hits and evictions within its budget, and exit 0.
(20 s are too short to tell a leak from the allocator warming up: the RSS slope bound here is loose;
``make soak`` holds it to 1 MiB per minute.)"""

import json

from h2okv.tools import soak


def test_short_soak(tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = soak.main(["--duration", "20", "--clients", "32", "--max-rss-slope", "200", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, (report["failures"], report["checks"])
    assert report["passed"] and report["failures"] == [] and report["kv_bytes_in_use_end"] == 0
    assert report["counts"]["valid_completed"] > 0 and report["bad_requests"] > 0
    assert report["checks"]["no_5xx"] and isinstance(report["rss_slope_mib_per_min"], float)
    assert any(kind.startswith("edge_") for kind in report["counts"])
    assert report["exit_code"] == 0
    store = report["prefix_cache"]
    assert report["config"]["prefix_cache_memory"] == 1 << 20  # the default: the store on
    assert store["hits"] > 0 and store["misses"] > 0 and store["evictions"] > 0
    assert 0 < store["bytes_end"] <= 1 << 20 and store["entries_end"] > 0
    assert report["counts"]["conversation_turns_resumed"] > 0 and report["counts"]["conversations_completed"] > 0
    assert {"prefix_store_hits_and_evicts", "prefix_store_within_budget", "conversations_resumed"} <= set(report["checks"])
    capsys.readouterr()
