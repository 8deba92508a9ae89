"""The soak run, short (``make soak`` runs it for 150 s with 64 clients): a real server process under
mixed valid, abandoned and malformed traffic ends with no failures, no KV memory held, and exit 0."""

import json

from h2okv.tools import soak


def test_short_soak(tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = soak.main(["--duration", "20", "--clients", "32", "--rss-tolerance", "0.25", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, (report["failures"], report["checks"])
    assert report["passed"] and report["failures"] == [] and report["kv_bytes_in_use_end"] == 0
    assert report["counts"]["valid_completed"] > 0 and report["bad_requests"] > 0
    assert report["exit_code"] == 0
    capsys.readouterr()
