"""The command line: one-line errors with exit code 2, and a real generate run on a tiny model."""

import pytest

from h2okv import cli


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["generate", "--prompt", "hi", "--policy", "bogus"], "unknown policy"),
        (["generate", "--prompt", "hi", "--policy", "snapkv:window=-1"], "window must be >= 1"),
        (["generate", "--prompt", "hi", "--policy", "tova", "--heavy", "0", "--recent", "4"], "each of --heavy and --recent"),
        (["generate", "--prompt", "hi", "--heavy", "0", "--recent", "4"], "each of --heavy and --recent"),
        (["generate", "--prompt", "hi", "--heavy-ratio", "1.5", "--recent-ratio", "0.1"], "(0, 1]"),
        (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
        (["generate", "--prompt", "   "], "prompt is empty"),
        (["generate"], "--prompt"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "must be a positive integer (> 0)"),
        (["generate", "--prompt", "hi", "--model", "/nonexistent/model-dir"], "not found"),
        (["generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf"], "not found"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "must be a finite number >= 0"),
        (["generate", "--prompt", "hi", "--temperature", "nan"], "must be a finite number >= 0"),
        (["generate", "--prompt", "hi", "--top-p", "1.5"], "must be in (0, 1]"),
        (["generate", "--prompt", "hi", "--repetition-penalty", "0"], "must be a positive number"),
    ],
)
def test_bad_input_one_line_exit_2(capsys, argv, fragment):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_generate_on_tiny_model(capsys, monkeypatch, tmp_path):
    """`generate` end to end with the tokenizer of the default model and a tiny model in its place."""
    import h2okv.models
    from h2okv.tools.tiny import tiny_model

    model = tiny_model("llama", vocab_size=49152)

    class Tok:
        pad_token_id = 0

        def __call__(self, text, return_tensors=None):
            import torch

            ids = torch.tensor([[(ord(c) % 90) + 2 for c in text]])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(int(i)) for i in ids)

    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, Tok()))
    prompt = tmp_path / "p.txt"
    prompt.write_text("x" * 50)
    code, out, err = run_cli(capsys, "generate", "--prompt-file", str(prompt), "--heavy", "3", "--recent", "4",
                             "--max-new-tokens", "6")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines[0].split()) == 6  # six generated token ids
    assert lines[-1].startswith("[h2o] tokens seen 55, slots kept 7 per layer/head")
    assert "MiB vs full-cache" in lines[-1]


def test_generate_samples_reproducibly_with_a_seed(tiny_dir):
    """--temperature samples (greedy at 0), seeded: the same seed gives the same tokens, and a high
    temperature on a random model leaves the greedy path."""
    from h2okv.generation import generate
    from h2okv.models import load_model

    model, tokenizer = load_model(str(tiny_dir), cache=False)
    prompt = " ".join(f"w{i}" for i in range(5, 30))
    run = lambda **kw: generate(model, tokenizer, prompt, heavy=4, recent=4, max_new_tokens=24, **kw).token_ids  # noqa: E731
    greedy = run()
    assert run(temperature=0.0, seed=5) == greedy  # temperature 0: the seed does not matter
    sampled = run(temperature=5.0, seed=1)
    assert run(temperature=5.0, seed=1) == sampled
    assert sampled != greedy and run(temperature=5.0, seed=2) != sampled
    assert len(run(repetition_penalty=1.3)) == 24
    # make greedy's first token the end of sequence: generation stops there unless told not to
    stop, model.generation_config.eos_token_id = model.generation_config.eos_token_id, greedy[0]
    try:
        assert len(run()) == 1
        ignoring = run(ignore_eos=True)
        assert len(ignoring) == 24 and greedy[0] not in ignoring
    finally:
        model.generation_config.eos_token_id = stop


def test_generate_chat_without_a_template_is_one_line(capsys, tiny_dir):
    """The word-level test tokenizer has no chat template: --chat says so instead of a traceback."""
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--chat", "--prompt", "w5 w6",
                             "--max-new-tokens", "2")
    assert code == 2
    # the model loads first (its progress bar is on stderr); the error is the last line, and one line
    assert err.strip().splitlines()[-1].startswith("h2okv: error: --chat needs a tokenizer with a chat template")
    assert "Traceback" not in err


# -- shared argument types (h2okv.cli.args) ------------------------------------------------------------
def test_byte_sizes_are_binary_whatever_the_spelling():
    from h2okv.cli.args import parse_bytes

    assert parse_bytes("2G") == parse_bytes("2GB") == parse_bytes("2GiB") == parse_bytes("2gib") == 2 * 2**30
    assert parse_bytes("1.5M") == parse_bytes("1.5 MiB") == int(1.5 * 2**20)
    assert parse_bytes("2147483648") == 2**31 and parse_bytes("512B") == 512
    assert parse_bytes("64K") == 64 * 1024 and parse_bytes("1T") == 2**40


@pytest.mark.parametrize("text", ["lots", "", "0", "-5", "2X", "2iB", "1e9", "nan", "inf", "2 G B"])
def test_bad_byte_sizes_are_refused(text):
    import argparse

    from h2okv.cli.args import parse_bytes

    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse_bytes(text)
    assert "\n" not in str(info.value) and repr(text) in str(info.value)


def test_kv_memory_takes_inf_for_no_limit():
    from h2okv.cli.args import memory_limit

    assert memory_limit("inf") is None and memory_limit("512M") == 512 * 2**20


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["bench", "--memory-cap", "2 lots", "--json", "x.json"], "argument --memory-cap: expected a byte size"),
        (["serve", "--kv-memory=-1G"], "argument --kv-memory: expected a byte size"),
        (["serve-bench", "--kv-memory", "0"], "argument --kv-memory: must be a positive byte size"),
    ],
)
def test_bad_byte_size_options_are_one_line_errors(capsys, argv, fragment):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_memory_cap_reaches_the_bench_config_in_binary_bytes():
    from h2okv.cli.bench import config_from_args
    from h2okv.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--memory-cap", "2GB", "--json", "x.json"])
    assert config_from_args(args).memory_cap == 2 * 2**30


def test_serve_says_at_startup_what_a_request_runs():
    from h2okv.cli.serve import DEFAULT_PREFIX_MEMORY, DEFAULT_RECIPE, serving_line
    from h2okv.serve.eviction import EvictionDefaults

    line = serving_line(EvictionDefaults.from_options(recipe=DEFAULT_RECIPE), None, DEFAULT_PREFIX_MEMORY)
    assert line.startswith("h2okv: requests run the bounded recipe (snapkv:window=32,kernel=31,pool=max,words=1) at 20%, chunked prefill")
    assert "KV memory no limit, prefix store 512 MiB" in line and "\n" not in line
    line = serving_line(EvictionDefaults.from_options(policy="h2o", budget=256), 2 << 30, 0)
    assert "requests run h2o at 256 slots" in line and "KV memory 2048 MiB, prefix store off" in line


@pytest.mark.parametrize("argv, stored", [([], 512 << 20), (["--prefix-cache-memory", "0"], 0),
                                          (["--prefix-cache-memory", "off"], 0), (["--prefix-cache-memory", "1G"], 1 << 30)])
def test_the_prefix_store_is_on_by_default_and_can_be_turned_off(argv, stored):
    from h2okv.cli.main import build_parser

    assert build_parser().parse_args(["serve", *argv]).prefix_cache_memory == stored


@pytest.mark.parametrize(
    "parse, text, ok",
    [("positive_int", "3", 3), ("positive_float", "0.5", 0.5), ("positive_seconds", "1e3", 1000.0)],
)
def test_positive_numbers(parse, text, ok):
    import argparse

    from h2okv.cli import args

    assert getattr(args, parse)(text) == ok
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive"):
            getattr(args, parse)(bad)
