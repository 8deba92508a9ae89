"""tools/peer/run_keys_values.py without keys_values or litgpt (they live in .venv-peer-kv only): its
argument errors, its budget mapping against h2okv's, its decoding loop on a scripted model, and its
rows, which have kvpress's reasoning rows' shape, resume, and merge in ``reasoning-report``."""

import json
from types import SimpleNamespace

import pytest
import torch

from h2okv.core.budget import BudgetSpec
from h2okv.eval.reasoning import EXPORT_FORMAT, config_label
from source_imports import top_level_imports
from tool_scripts import TOOLS, load_tool

RUNNER = TOOLS / "peer" / "run_keys_values.py"


@pytest.fixture(scope="module")
def runner():
    return load_tool("peer/run_keys_values.py")


@pytest.fixture
def exported(tmp_path):
    data = {"format": EXPORT_FORMAT, "model_path": str(tmp_path / "model"),
            "setup": {"model": "qwen2.5-0.5b", "task": "gsm8k", "style": "chat", "max_new_tokens": 5,
                      "batch_size": 8, "seed": 0},
            "budgets": [128], "decoding": "greedy", "eos_ids": [9],
            "problems": [{"id": i, "prompt_ids": [1, 2, 3][: i + 1], "gold": str(i), "stop": []} for i in range(3)]}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(data))
    return data, path


def test_runner_does_not_import_h2okv():
    """h2okv (and lm-eval) are not installed in the peer's venv; keys_values and litgpt are
    imported inside functions, so the module loads in h2okv's venv for these tests."""
    imported = top_level_imports(RUNNER)
    assert not imported & {"h2okv", "lm_eval"} and {"torch", "keys_values", "litgpt", "transformers"} <= imported
    source = RUNNER.read_text()
    assert "\nimport torch" not in source and "\nfrom keys_values" not in source and "\nfrom litgpt" not in source


def one_line_exit(capsys, call, match: str):
    with pytest.raises(SystemExit) as caught:
        call()
    err = capsys.readouterr().err
    assert caught.value.code == 2 and match in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("args", "match"), [
    (["--budgets", "0"], "'0' is neither"), (["--budgets", "0.25"], "'0.25' is neither"),
    (["--budgets", "128,fulll"], "'fulll' is neither"), (["--budgets", ","], "'' is neither"),
    (["--budgets", "128", "--recent-share", "1"], "no heavy-hitter slot"),
    (["--budgets", "1"], "no heavy-hitter slot"),  # 1 slot, half recent: the recent slot is all of it
    (["--recent-share", "1.5"], "must be in [0, 1]"), (["--limit", "0"], "--limit must be >= 1"),
])
def test_bad_arguments_are_one_line_errors(runner, exported, tmp_path, capsys, args, match):
    _, path = exported
    one_line_exit(capsys, lambda: runner.main([str(path), "--json", str(tmp_path / "out.json"), *args]), match)
    assert not (tmp_path / "out.json").exists()


def test_bad_inputs_are_one_line_errors(runner, exported, tmp_path, capsys):
    data, path = exported
    out = ["--json", str(tmp_path / "out.json")]
    one_line_exit(capsys, lambda: runner.main([str(tmp_path / "missing.json"), *out]), "cannot read")
    (tmp_path / "other.json").write_text(json.dumps({**data, "format": "h2okv-retrieval-prompts/1"}))
    one_line_exit(capsys, lambda: runner.main([str(tmp_path / "other.json"), *out]), "is not an h2okv-reasoning")
    one_line_exit(capsys, lambda: runner.main([str(path), "--model-dir", str(tmp_path / "nowhere"), *out]),
                  "is not an HF checkpoint folder")
    (tmp_path / "moved.json").write_text(json.dumps({**data, "model_path": str(tmp_path / "gone")}))
    one_line_exit(capsys, lambda: runner.main([str(tmp_path / "moved.json"), *out]), "the export's model_path")
    one_line_exit(capsys, lambda: runner.litgpt_name({"model_type": "llama", "num_hidden_layers": 30}),
                  "no LitGPT config known")
    (tmp_path / "out.json").write_text(json.dumps({"format": "h2okv-reasoning/1", "setup": {"model": "x"}}))
    one_line_exit(capsys, lambda: runner.read_piece(str(tmp_path / "out.json"), {"model": "y"}), "use another --json")


def test_budgets_and_recent_window_map_as_eval_reasoning(runner):
    assert runner.parse_budgets("128, full,64,128") == [128, None, 64]
    for budget in (4, 5, 64, 127, 128, 512):  # (2 at share 0.75 is all recent: refused, see above)
        for share in (0.0, 0.25, 0.5, 0.75):
            assert runner.recent_slots(budget, share) == BudgetSpec.from_slots(budget, share).recent
    for share in (0.25, 0.5):  # the label eval reasoning gives its own h2o at that share, prefixed
        assert runner.policy_label(128, share) == "keys_values-" + config_label("h2o", share)
    assert runner.policy_label(None, 0.25) == "keys_values-full"


def test_litgpt_names_and_one_conversion(runner, tmp_path):
    shape = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}
    assert runner.litgpt_name(shape) == "Qwen2.5-Coder-0.5B-Instruct"
    assert runner.litgpt_name({**shape, "num_hidden_layers": 28, "hidden_size": 1536, "num_attention_heads": 12,
                               "intermediate_size": 8960}) == "Qwen2.5-Coder-1.5B-Instruct"
    hf = tmp_path / "Qwen-hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(shape))
    (hf / "tokenizer.json").write_text("{}")
    calls = []

    def convert(folder, name):
        calls.append((folder, name))
        (folder / "lit_model.pth").write_text("weights")

    first = runner.litgpt_checkpoint(hf, tmp_path / "cache", convert)
    assert first == tmp_path / "cache" / "Qwen-hf" and calls == [(first, "Qwen2.5-Coder-0.5B-Instruct")]
    assert (first / "tokenizer.json").resolve() == (hf / "tokenizer.json").resolve()
    assert runner.litgpt_checkpoint(hf, tmp_path / "cache", convert) == first and len(calls) == 1  # once


class ScriptedGPT(torch.nn.Module):
    """keys_values' GPT as the runner uses it: one call per token, the logits scripted (the argmax
    of call i is ``script[i]``), caches that count what they read."""

    def __init__(self, script, cache_length):
        super().__init__()
        self.script, self.calls = script, 0
        self.lm_head = torch.nn.Identity()
        self.transformer = torch.nn.ModuleDict({"ln_f": torch.nn.Identity()})
        self.config = SimpleNamespace(n_query_groups=2, head_size=4)
        self.caches = [SimpleNamespace(input_pos=0, cache_length=cache_length) for _ in range(3)]

    def get_kv_caches(self):
        return self.caches

    def hidden(self, tokens: int):
        for cache in self.caches:
            cache.input_pos += tokens
        self.calls += 1
        return torch.nn.functional.one_hot(torch.tensor([[self.script[self.calls - 1]]]), 16).float()

    def forward(self, x):
        return self.lm_head(self.transformer.ln_f(self.hidden(x.shape[-1])))


class ScriptedLongContext:
    """keys_values' LongContextInferenceModel: resets the caches, reads the prompt, and (its bug)
    applies ``lm_head`` without ``ln_f``."""

    def __init__(self, gpt):
        self.gpt_model = gpt

    def __call__(self, prompt, targets):
        for cache in self.gpt_model.caches:
            cache.input_pos = 0
        return self.gpt_model.lm_head(self.gpt_model.hidden(prompt.shape[-1]))


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


@pytest.mark.parametrize(("script", "stop", "cache_length", "tokens", "finish", "slots"), [
    ([1, 2, 9], [], 100, [1, 2], "eos", 3 + 2),  # the EOS is not kept; the cache read prompt + 2
    ([1, 2, 3, 4, 5], [], 100, [1, 2, 3, 4, 5], "length", 3 + 4),  # the fifth token is never read
    ([1, 2, 3, 4, 5], [], 4, [1, 2, 3, 4, 5], "length", 4),  # a budget holds its slots, no more
    ([1, 2, 3, 4, 5], ["cd"], 100, [1, 2, 3], "stop", 3 + 2),  # "bcd" holds the stop string
])
def test_decoding_ends_as_eval_reasoning_and_counts_kv(runner, script, stop, cache_length, tokens, finish, slots):
    gpt = ScriptedGPT(script, cache_length)
    normed = []
    gpt.transformer.ln_f.register_forward_hook(lambda *args: normed.append(gpt.calls))
    cut = load_tool("peer/decoding_kvpress.py").cut_at_stop
    result = runner.decode_problem(ScriptedLongContext(gpt), CharTokenizer(), {"prompt_ids": [5, 6, 7], "stop": stop},
                                   5, {9}, cut)
    assert result["token_ids"] == tokens and result["finish"] == finish
    assert result["kv_slots"] == slots and result["kv_bytes"] == 3 * 2 * 2 * 4 * 4 * slots  # layers, K+V, heads, D, fp32
    assert result["text"] == cut(CharTokenizer().decode(tokens), stop)
    assert normed[0] == 1 and isinstance(gpt.lm_head, torch.nn.Identity)  # the prompt pass was normed, then undone
    assert gpt.max_seq_length == 3 + 5


def fake_decoder(calls, fail_on=None):
    def decoder_for(budget, recent):
        def decode(problem):
            if problem["id"] == fail_on:
                raise KeyboardInterrupt
            calls.append((budget, recent, problem["id"]))
            return {"token_ids": [4] * (problem["id"] + 1), "finish": "eos", "kv_bytes": 100 * (problem["id"] + 1),
                    "kv_slots": 10, "text": f"so \\boxed{{{problem['id']}}}", "prefill_seconds": 0.5,
                    "decode_seconds_per_token": 0.25}
        return decode
    return decoder_for


def test_rows_have_kvpress_shape_resume_and_merge(runner, exported, tmp_path):
    from h2okv.eval.reasoning_report import merge

    data, _ = exported
    out, calls = tmp_path / "piece.json", []
    with pytest.raises(KeyboardInterrupt):  # interrupted at problem 1 of budget 128: problem 0 is written
        runner.run(data, [128, None], 0.5, str(out), fake_decoder(calls, fail_on=1))
    assert [(r["policy"], r["id"]) for r in json.loads(out.read_text())["rows"]] == [("keys_values-h2o", 0)]

    calls.clear()
    piece = runner.run(data, [128, None], 0.5, str(out), fake_decoder(calls))
    assert calls == [(128, 64, 1), (128, 64, 2), (None, 0, 0), (None, 0, 1), (None, 0, 2)]  # 0 @ 128 skipped
    assert piece == json.loads(out.read_text()) and piece["setup"] == {**data["setup"], "batch_size": 1}
    kvpress = load_tool("peer/decoding_kvpress.py")
    for row in piece["rows"]:
        problem = data["problems"][row["id"]]
        result = {"token_ids": [4] * (row["id"] + 1), "finish": "eos", "kv_bytes": 100 * (row["id"] + 1),
                  "kv_slots": 10, "text": f"so \\boxed{{{row['id']}}}"}
        assert row == kvpress.reasoning_row(piece["setup"], problem, result, row["policy"], row["budget"])
        assert list(row) == list(kvpress.reasoning_row(piece["setup"], problem, result, "p", 1))  # same order
    assert [(b["policy"], b["budget"]) for b in piece["batches"]] == [("keys_values-h2o", 128)] * 3 + [
        ("keys_values-full", None)] * 3
    assert all(b["decode_seconds_per_token"] == 0.25 and b["rows"] == 1 for b in piece["batches"])
    assert set(piece["peer"]) == {"keys_values-h2o", "keys_values-full"}
    assert "grace_period=64 of 128" in piece["peer"]["keys_values-h2o"]

    calls.clear()  # a finished piece runs nothing
    assert runner.run(data, [128, None], 0.5, str(out), fake_decoder(calls)) == piece and calls == []

    rows, batches = merge([out])  # reasoning-report grades the peer's text with our answers.py
    assert {(r["policy"], r["id"]): r["correct"] for r in rows} == {
        (p, i): True for p in ("keys_values-h2o", "keys_values-full") for i in range(3)}
    assert len(batches) == 6
