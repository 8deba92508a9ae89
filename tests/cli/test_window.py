"""A prompt past the model's window is refused before any forward pass (it used to run for minutes
and print garbage): one line naming the window and the prompt, pointing to rolling positions,
which lift the check and read such a prompt in pieces."""

import pytest
import torch

from h2okv import H2OError, cli
from h2okv.generation import generate
from h2okv.tools.tiny import tiny_model

WINDOW = 64


class Tok:
    """One id per character (the tiny model's vocabulary)."""

    pad_token_id = 0

    def __call__(self, text, return_tensors=None):
        ids = torch.tensor([[(ord(c) % 90) + 2 for c in text]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


@pytest.fixture
def model():
    model = tiny_model("llama", max_position_embeddings=WINDOW)
    model.forwards = 0

    def count(module, args, kwargs):
        module.forwards += 1

    model.register_forward_pre_hook(count, with_kwargs=True)
    return model


@pytest.mark.parametrize("prompt, new, message", [
    (100, 4, "the prompt has 100 tokens and the model's window is 64 positions"),
    (64, 1, "the prompt has 64 tokens and the model's window is 64 positions"),
    (60, 10, "the prompt's 60 tokens and max_new_tokens=10 pass the model's window of 64 positions: "
             "give max_new_tokens=4 or less"),
])
def test_the_library_refuses_before_any_forward_pass(model, prompt, new, message):
    with pytest.raises(H2OError) as info:
        generate(model, Tok(), "x" * prompt, max_new_tokens=new)
    assert message in str(info.value) and "recipe='stream'" in str(info.value)
    assert model.forwards == 0


def test_a_prompt_that_fits_still_generates(model):
    assert generate(model, Tok(), "x" * 60, max_new_tokens=4, ignore_eos=True).new_tokens == 4


@pytest.mark.parametrize("settings", [{"recipe": "stream"}, {"positions": "rolling:order", "budget": 16}])
def test_rolling_positions_lift_the_check_and_read_in_pieces(model, settings):
    out = generate(model, Tok(), "x" * 150, max_new_tokens=6, ignore_eos=True, **settings)
    assert out.new_tokens == 6 and out.stats["tokens_seen"] == 155  # the last new token is never fed
    assert model.forwards > 6 + 1  # the prompt was read in several calls, none past the window


def test_the_command_line_exits_2_with_flags(capsys, monkeypatch, tmp_path, model):
    import h2okv.models

    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, Tok()))
    prompt = tmp_path / "long.txt"
    prompt.write_text("x" * 100)
    code = cli.main(["generate", "--prompt-file", str(prompt)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and model.forwards == 0
    assert err == ("h2okv: error: the prompt has 100 tokens and the model's window is 64 positions: shorten it, "
                   "or read past the window with rolling positions (--recipe stream)")
    code = cli.main(["generate", "--prompt", "x" * 60, "--max-new-tokens", "10"])
    assert code == 2 and "give --max-new-tokens 4 or less" in capsys.readouterr().err
    code = cli.main(["generate", "--prompt-file", str(prompt), "--recipe", "stream", "--max-new-tokens", "3",
                     "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "tokens seen 102" in out.splitlines()[-1]
