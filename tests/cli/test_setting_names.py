"""A bad budget is named as the caller names it: ``--budget`` on the command line, ``budget=`` in
Python (``h2o.budget`` over HTTP: tests/serve/test_setting_names.py), and every message says the range."""

import re

import pytest

from h2okv import H2OError, cli
from h2okv.settings import CacheSettings

RULE = "must be a fraction of the prompt in (0, 1] (e.g. 0.2) or a whole number of slots >= 2 for h2o (e.g. 256)"


def cli_error(capsys, *argv) -> str:
    code = cli.main(["generate", "--prompt", "hi", *argv])  # refused before any model loads
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err.strip().removeprefix("h2okv: error: ")


@pytest.mark.parametrize("argv, message", [
    (["--budget", "1.5"], f"--budget {RULE}, got 1.5"),  # has a point, but is no fraction
    (["--budget", "1"], f"--budget {RULE}, got 1"),  # was about heavy=0, recent=1, never given
    (["--budget", "20%"], f"--budget {RULE}, got '20%'"),
    (["--budget", "0.2", "--heavy", "10"], "give either --budget or --heavy, not both"),
    (["--policy", "local", "--budget", "0"], "--budget must be a fraction of the prompt in (0, 1] (e.g. 0.2) or a "
                                             "whole number of slots >= 1 for local (e.g. 256), got 0"),
    (["--budget", "0.2", "--recent-share", "1"], "--recent-share 1.0 leaves h2o no heavy slots"),
    (["--heavy", "0", "--recent", "4"], "it needs at least 1 slot in each of --heavy and --recent, got 0 and 4"),
    (["--heavy-ratio", "2", "--recent-ratio", "0.1"], "--heavy-ratio must be a fraction of the prompt in (0, 1]"),
    (["--budget-floor", "-1"], "--budget-floor must be a whole number of slots >= 0, got -1"),
    (["--policy", "full", "--budget", "0.2"], "policy 'full' keeps every token; do not give it --budget"),
])
def test_the_command_line_names_flags(capsys, argv, message):
    said = cli_error(capsys, *argv)
    assert message in said
    assert not re.search(r"\w=", said.replace(">=", ""))  # no Python keywords (budget=, heavy=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 1.5}, f"budget= {RULE}, got 1.5"),
    ({"budget": 0.2, "heavy": 10}, "give either budget= or heavy=, not both"),
    ({"heavy": 4, "recent": 4, "recent_share": 0.3}, "recent_share= splits budget="),
])
def test_the_library_names_keywords(kwargs, message):
    with pytest.raises(H2OError) as info:
        CacheSettings.build(**kwargs)
    assert message in str(info.value) and "--" not in str(info.value)


def test_the_least_slot_count_follows_the_policy_and_share():
    from h2okv.core.budget import least_slots
    from h2okv.policies import make_policy

    assert least_slots(make_policy("h2o")) == 2  # a heavy and a recent slot
    assert least_slots(make_policy("h2o"), 0.75) == 4  # int(4 * 0.25) = 1 heavy slot
    assert least_slots(make_policy("local")) == 1
    CacheSettings.build(budget=2)  # the least is accepted
    CacheSettings.build(policy="h2o", budget=4, recent_share=0.75)
