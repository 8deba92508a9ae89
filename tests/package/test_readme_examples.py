"""README's examples, run as a user would copy them, on the real default model: each answers a
short one-fact chat question as the full cache does. The Python snippet runs verbatim in a fresh
interpreter with none of the extras installed (a core install)."""

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from h2okv import cli
from without_extras import EXTRA_ONLY, run_without

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
QUESTION = "What is the capital of France?"


def python_snippet() -> str:
    return re.search(r"```python\n(.*?)```", README, re.S).group(1)


def command_line(prefix: str) -> list[str]:
    """README's example of ``h2okv <prefix> ...`` (from the commands table), as argv."""
    line = re.search(rf"`(h2okv {prefix} [^`]*)`", README).group(1)
    return line.split()[1:]


def test_the_python_snippet_answers_as_the_full_cache_in_a_core_install():
    snippet = python_snippet()
    assert QUESTION in snippet and 'recipe="bounded", budget=0.2' in snippet
    ran = run_without(EXTRA_ONLY, snippet)
    assert ran.returncode == 0, ran.stderr[-2000:]
    full = run_without(EXTRA_ONLY, snippet.replace('recipe="bounded", budget=0.2', 'policy="full"'))
    assert full.returncode == 0, full.stderr[-2000:]
    answer, summary = ran.stdout.strip().splitlines()[-2:]
    assert answer == full.stdout.strip().splitlines()[-2] and "Paris" in answer
    assert summary.startswith("snapkv:window=32,kernel=31,pool=max,words=1 (recipe bounded):")


def test_the_generate_example_answers_as_the_full_cache(capsys):
    argv = command_line("generate")
    assert argv[argv.index("--prompt") + 1] == '"..."'
    argv[argv.index("--prompt") + 1] = QUESTION
    full = list(argv)  # the same command with the full cache in place of the recipe
    for flag in ("--recipe", "--budget"):
        del full[full.index(flag):full.index(flag) + 2]
    outputs = {}
    for name, command in (("recipe", argv), ("full", full + ["--policy", "full"])):
        code = cli.main(command)
        out, err = capsys.readouterr()
        assert code == 0, err
        outputs[name] = out.strip().splitlines()
    assert outputs["recipe"][:-1] == outputs["full"][:-1] and "Paris" in " ".join(outputs["recipe"])
    assert "recipe bounded" in outputs["recipe"][-1]


def test_the_serve_example_and_the_server_default_answer_as_the_full_cache(default_model):
    from h2okv.serve import EvictionDefaults, create_app, running_server

    model, tokenizer = default_model
    from h2okv.cli.serve import DEFAULT_RECIPE

    argv = command_line("serve")
    args = dict(zip(argv[1::2], argv[2::2], strict=False))
    # README's command gives no recipe: the server's default, the bounded recipe at 20%
    assert "--recipe" not in args and "--policy" not in args and DEFAULT_RECIPE == "bounded"
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
            "temperature": 0}
    for eviction in (EvictionDefaults.from_options(recipe=DEFAULT_RECIPE, budget=0.2), EvictionDefaults()):
        app = create_app(model, tokenizer, eviction=eviction)
        with running_server(app) as url:
            answers = {}
            for name, extra in (("served", {}), ("full", {"h2o": {"policy": "full"}})):
                reply = httpx.post(url + "/v1/chat/completions", json={**chat, **extra}, timeout=120).json()
                answers[name] = reply["choices"][0]["message"]["content"]
        assert answers["served"] == answers["full"] and "Paris" in answers["served"], (eviction, answers)


def test_readme_stays_short_and_names_no_issues():
    assert len(README.splitlines()) <= 200
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\bissues? \d", text, re.I), path
        assert not re.search(r"20\d\d-\d\d-\d\d", text), path  # no dates of work: git keeps the history
    assert len((ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8").splitlines()) <= 500


def test_help_texts_name_no_issues():
    for argv in (["--help"], ["generate", "--help"], ["serve", "--help"], ["eval", "longctx", "--help"],
                 ["eval", "retrieval", "--help"], ["eval", "reasoning", "--help"], ["bench", "--help"]):
        out = subprocess.run([sys.executable, "-m", "h2okv.cli", *argv], capture_output=True, text=True, cwd=ROOT).stdout
        assert out and not re.search(r"\bissues? \d", out, re.I), argv
