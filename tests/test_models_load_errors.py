"""A local model folder that cannot be loaded is one full-sentence line that says what is missing and
what to do (h2okv.models), never transformers' message cut at its first line."""

import pytest

from h2okv import models
from h2okv.cli import main
from h2okv.errors import H2OError
from h2okv.tools.tiny import tiny_model, word_tokenizer


@pytest.fixture
def folder(tmp_path):
    """A tiny Llama's config and weights, and no tokenizer files (what model.save_pretrained alone leaves)."""
    tiny_model("llama").save_pretrained(tmp_path)
    return tmp_path


def load_error(name) -> str:
    with pytest.raises(H2OError) as caught:
        models.load_model(str(name), cache=False)
    message = str(caught.value)
    assert "\n" not in message and message.endswith(".") and not message.endswith(": .")
    return message


def test_a_folder_without_a_tokenizer_says_so_and_how_to_fix_it(folder):
    message = load_error(folder)
    assert message.startswith(f"cannot load model {str(folder)!r}: the folder has no tokenizer files")
    assert "tokenizer.save_pretrained(folder)" in message and "one of" not in message


def test_the_cli_gives_that_message_as_one_line(folder, capsys):
    assert main(["generate", "--model", str(folder), "--prompt", "w2 w3", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error: cannot load model") and "\n" not in err
    assert "no tokenizer files" in err and err.endswith(".")


@pytest.mark.parametrize("remove, missing", [("config.json", "no config.json"),
                                             ("model.safetensors", "no weights (model.safetensors")])
def test_a_folder_without_config_or_weights_says_which(folder, remove, missing):
    word_tokenizer().save_pretrained(folder)
    (folder / remove).unlink()
    message = load_error(folder)
    assert missing in message and "save_pretrained(folder)" in message


def test_a_corrupt_file_keeps_transformers_whole_message_and_what_to_check(folder):
    word_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    message = load_error(folder)
    assert message.startswith(f"cannot load the weights of model {str(folder)!r}: ")
    assert message.endswith("Check that it is a causal language model whose weights match its config.json.")


def test_one_line_keeps_a_multi_line_message_whole():
    exc = ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a serialization file, \n"
                     "(2) a slow tokenizer. \nYou need sentencepiece installed")
    assert models.one_line(exc) == ("Couldn't instantiate the backend tokenizer from one of: (1) a serialization "
                                    "file, (2) a slow tokenizer. You need sentencepiece installed.")
    assert models.one_line(ValueError("cut here: ")) == "cut here."
    long = ValueError("First sentence. " + "word " * 200)
    assert models.one_line(long) == "First sentence."
