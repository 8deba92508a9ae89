"""``--recipe`` and ``--budget`` on every command that takes them: a recipe runs with its own
settings, and an unknown recipe or a bad budget is a one-line error with exit code 2 before any
model is loaded."""

import json

import pytest

from h2okv import cli


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--prompt", "hi", "--recipe", "fastest"], "unknown recipe 'fastest'"),
    (["generate", "--prompt", "hi", "--budget", "1.5"], "--budget must be a fraction of the prompt in (0, 1] (e.g. 0.2) or a whole number of slots >= 2 for h2o"),
    (["generate", "--prompt", "hi", "--budget", "0"], "--budget must be a fraction of the prompt in (0, 1] (e.g. 0.2) or a whole number of slots >= 2 for h2o"),
    (["generate", "--prompt", "hi", "--budget", "0.2", "--heavy", "4"], "not both"),
    (["generate", "--prompt", "hi", "--recent-share", "2"], "must be a share in [0, 1]"),
    (["generate", "--prompt", "hi", "--heavy", "3", "--recent", "3", "--recent-share", "0.1"], "--recent-share splits --budget"),
    (["generate", "--prompt", "hi", "--policy", "full", "--budget", "0.2"], "keeps every token"),
    (["serve", "--recipe", "fastest"], "unknown recipe 'fastest'"),
    # serve's default is the bounded recipe (snapkv)
    (["serve", "--budget", "abc"], "--budget must be a fraction of the prompt in (0, 1] (e.g. 0.2) or a whole number of slots >= 2 for snapkv"),
    (["serve", "--budget", "0.2", "--heavy-ratio", "0.1"], "not both"),
    (["eval", "retrieval", "--recipe", "bounded,nope"], "unknown recipe 'nope'"),
    (["eval", "longctx", "--recipe", "nope"], "unknown recipe 'nope'"),
    (["eval", "reasoning", "--recipe", "nope"], "unknown recipe 'nope'"),
    (["eval", "reasoning", "--recipe", "generation", "--recent-share", "0.2"], "differs from recipe generation"),
])
def test_bad_recipes_and_budgets_are_one_line_errors(capsys, argv, fragment):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_generate_with_a_recipe_and_a_slot_budget(capsys, tiny_dir):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--prompt",
                             " ".join(f"w{i}" for i in range(5, 45)), "--recipe", "bounded", "--budget", "20",
                             "--max-new-tokens", "3")
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("[snapkv:window=32,kernel=31,pool=max,words=1, recipe bounded] tokens seen")
    assert "slots kept 20 per layer/head" in last


def test_generate_runs_the_document_recipe(capsys, tiny_dir):
    """kvzip reads and ranks the prompt (all but its last token) by reconstruction, then decodes."""
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--prompt",
                             " ".join(f"w{i}" for i in range(5, 65)), "--recipe", "document", "--budget", "0.25",
                             "--budget-floor", "0", "--max-new-tokens", "2")
    assert code == 0, err
    assert "[kvzip, recipe document]" in out.strip().splitlines()[-1]


def test_generate_takes_every_knob_a_recipe_uses(capsys, tiny_dir):
    """The document recipe spelled out flag by flag: the same cache as the recipe's name."""
    prompt = " ".join(f"w{i}" for i in range(5, 65))
    base = ["generate", "--model", str(tiny_dir), "--prompt", prompt, "--budget", "0.25", "--budget-floor", "0",
            "--max-new-tokens", "3"]
    code, by_name, err = run_cli(capsys, *base, "--recipe", "document")
    assert code == 0, err
    code, spelled, err = run_cli(capsys, *base, "--policy", "kvzip", "--prefill", "late", "--head-budgets", "layers",
                                 "--head-floor", "0", "--recent-share", "0.01")
    assert code == 0, err
    assert by_name.splitlines()[0] == spelled.splitlines()[0]  # the same tokens
    assert by_name.splitlines()[-1].split("]", 1)[1] == spelled.splitlines()[-1].split("]", 1)[1]


def test_retrieval_runs_a_recipe_beside_full(capsys, tmp_path, tiny_dir):
    rows = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "eval", "retrieval", "--model", str(tiny_dir), "--recipe", "bounded",
                             "--budgets", "0.5", "--contexts", "64", "--depths", "0.5", "--trials", "1",
                             "--max-new-tokens", "2", "--json", str(rows), "--plot", "")
    assert code == 0, err
    cells = json.loads(rows.read_text())
    assert [c["policy"] for c in cells] == ["full", "snapkv:kernel=31,pool=max,words=1"]  # full by default
    recipe = cells[1]
    assert (recipe["recipe"], recipe["recent_share"], recipe["prefill"], recipe["budget"]) == ("bounded", 0.078, "streamed", 0.5)
    assert "recipe bounded" in out


def test_reasoning_rows_name_the_recipe():
    from h2okv.eval.reasoning import Setup, config_label

    setup = Setup(model="m", task="gsm8k", style="chat", max_new_tokens=8, batch_size=2, recipe="stream")
    assert setup.cache_options("h2o-mean") == {"prefill": "chunked", "positions": "rolling"}
    assert setup.cache_options("h2o") == {}  # another policy of the piece runs plainly
    assert config_label("h2o-mean", 0.5, "stream") == "h2o-mean recipe=stream"
    assert config_label("full", 0.5, "stream") == "full"


def test_reasoning_rows_name_a_protected_prompt(tmp_path, capsys):
    from h2okv.eval.reasoning import Setup, config_label

    setup = Setup(model="m", task="gsm8k", style="chat", max_new_tokens=8, batch_size=2, protect_prompt=True)
    assert setup.cache_options("h2o") == {"protect_prompt": True}
    assert setup.cache_options("full") == {}  # keeps everything anyway
    assert config_label("h2o", 0.5, None, True) == "h2o protect-prompt"
    assert config_label("tova", 0.25, None, True) == "tova recent=0.25 protect-prompt"
    assert config_label("full", 0.5, None, True) == "full"
    assert cli.main(["eval", "reasoning", "--protect-prompt", "--policies", "kvzip"]) == 2  # refused before loading


def test_reasoning_rows_say_their_slots_are_quantized_full_s_too():
    from h2okv.eval.reasoning import Setup, config_label

    setup = Setup(model="m", task="gsm8k", style="chat", max_new_tokens=8, batch_size=2, kv_bits=4)
    assert setup.cache_options("full") == {"kv_bits": 4, "kv_group": 32}  # quantization alone
    assert setup.cache_options("h2o") == {"kv_bits": 4, "kv_group": 32}
    assert config_label("full", 0.5, None, False, setup.kv_label) == "full kv_bits=4"
    assert config_label("h2o", 0.25, None, False, "4/64") == "h2o recent=0.25 kv_bits=4/64"
    keys_8 = Setup(model="m", task="gsm8k", style="chat", max_new_tokens=8, batch_size=2, kv_bits=4, key_bits=8)
    assert keys_8.kv_label == "k8v4" and keys_8.cache_options("h2o")["key_bits"] == 8
    assert cli.main(["eval", "reasoning", "--kv-bits", "3", "--limit", "1"]) == 2  # refused in one line


def test_longctx_recipes_and_options_reach_only_their_runs():
    from h2okv.eval.longctx.runner import Config, GridSpec

    spec = GridSpec(tasks=["vt"], contexts=[256], samples=1, policies=["full", "kvzip"], budgets=[0.2],
                    cache_options={"head_budgets": "layers"}, recipes=["bounded"])
    configs = spec.configs()
    assert configs[0] == Config("full", 1.0, {})  # full keeps everything: no option reaches it
    assert configs[1] == Config("kvzip", 0.2, {"prefill": "late", "head_budgets": "layers"})
    # the grid's --cache-option does not reach the recipe's run: it keeps its own configuration
    assert configs[2] == Config("snapkv:kernel=31,pool=max,words=1", 0.2, {"prefill": "streamed", "recent_share": 0.078}, "bounded")
    # ... but quantized slots reach every run, full's and the recipe's too
    coded = GridSpec(tasks=["vt"], contexts=[256], samples=1, policies=["full"], budgets=[0.2], recipes=["bounded"],
                     coding={"kv_bits": 4, "kv_group": 32}).configs()
    assert [c.options.get("kv_bits") for c in coded] == [4, 4] and coded[1].options["prefill"] == "streamed"


def test_lm_eval_model_takes_a_recipe(tiny_dir):
    pytest.importorskip("lm_eval")
    from h2okv import H2OError
    from h2okv.eval.lm_eval_model import H2OLM

    lm = H2OLM(pretrained=str(tiny_dir), recipe="bounded", budget="0.5")
    cache = lm._new_cache(4)
    assert cache.recipe == "bounded" and cache.policy.spec == "snapkv:window=32,kernel=31,pool=max,words=1"
    assert cache.spec.recent_ratio == pytest.approx(0.5 * 0.078) and cache.spec.floor == 0
    assert lm.get_model_info()["recipe"] == "bounded"
    with pytest.raises(H2OError, match="unknown recipe"):
        H2OLM(pretrained=str(tiny_dir), recipe="nope")
    with pytest.raises(H2OError, match="budget"):
        H2OLM(pretrained=str(tiny_dir), budget="lots")
