"""A ``--model`` that is neither built in nor a local path is a hub id: it loads from the Hugging Face
cache without asking the network, and otherwise fails at once in one line when the hub does not know
it or cannot be reached (transformers alone would retry every file for ~25 s, printing each retry).
No test here touches the network: offline mode or a stand-in for ``model_info`` answers."""

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError

from h2okv import models
from h2okv.cli.main import main
from h2okv.errors import H2OError


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def cache_config(cache, repo_id):
    """What ``hf download`` leaves for a repo's config.json: refs/main naming a snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")


def test_unreachable_hub_fails_at_once_naming_the_built_in_models(empty_hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(H2OError, match="hub cannot be reached") as caught:
        models.load_config("owner/no-such-model")
    assert "qwen2.5-0.5b" in str(caught.value) and "\n" not in str(caught.value)


def test_a_model_the_hub_does_not_know_is_named_unknown(empty_hub_cache, monkeypatch):
    def not_found(repo_id, **_):
        response = httpx2.Response(404, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{repo_id}"))
        raise RepositoryNotFoundError("404 Repository Not Found", response=response)

    monkeypatch.setattr(huggingface_hub, "model_info", not_found)
    with pytest.raises(H2OError, match="unknown model 'owner/typo'"):
        models.load_config("owner/typo")


def test_a_malformed_hub_id_is_named_unknown_without_asking_the_hub(empty_hub_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(H2OError, match="unknown model 'a/b/c'"):
        models.load_config("a/b/c")


def test_a_cached_hub_id_is_loaded_without_asking_the_hub(empty_hub_cache, monkeypatch):
    cache_config(empty_hub_cache, "owner/cached")
    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **k: pytest.fail("asked the hub"))
    assert models._source("owner/cached") == ("owner/cached", {})


def test_a_reachable_hub_id_is_handed_to_transformers(empty_hub_cache, monkeypatch):
    asked = []
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, **k: asked.append(repo_id))
    assert models._source("owner/remote") == ("owner/remote", {})
    assert asked == ["owner/remote"]


def test_cli_unknown_model_is_one_line_and_exit_2(empty_hub_cache, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["generate", "--model", "nope", "--prompt", "hello", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error: cannot load model 'nope'") and "\n" not in err
