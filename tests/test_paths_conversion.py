"""On-disk locations (h2okv.paths) and the converted-GGUF cache (h2okv.conversion): a converted folder
is reused only when it was finished by the same transformers version and conversion format."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from h2okv import cli, conversion, models, paths
from h2okv.errors import H2OError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("H2OKV_CACHE", str(root))
    return root


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "Tiny-Model.Q4_0.gguf"
    path.write_bytes(b"GGUF" + bytes(96))
    return path


@pytest.fixture
def conversions(monkeypatch):
    """Replace the dequantization with a quick fake that records each call (a folder of two files)."""
    calls = []

    def fake(gguf, folder):
        calls.append(folder)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "made_by": len(calls)}))
        (folder / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(conversion, "write_plain_checkpoint", fake)
    monkeypatch.setattr(conversion, "transformers_version", lambda: "5.23.0")
    return calls


def entries(cache):
    """What the cache folder holds, less the conversions' lock files (kept: removing one races)."""
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(".lock-"))


def made_by(folder):
    return json.loads((folder / "config.json").read_text())["made_by"]


def test_cache_root_from_env_or_home(monkeypatch, tmp_path):
    monkeypatch.setenv("H2OKV_CACHE", str(tmp_path / "c"))
    assert paths.cache_root() == tmp_path / "c"
    assert paths.models_dir() == tmp_path / "c" / "models"
    assert paths.qwen_path() == tmp_path / "c" / "models" / "Qwen2.5-Coder-0.5B-Instruct.gguf"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in (lambda: monkeypatch.delenv("H2OKV_CACHE"), lambda: monkeypatch.setenv("H2OKV_CACHE", "")):
        unset()
        assert paths.cache_root() == tmp_path / "home" / ".cache" / "h2okv"


def test_converted_folder_name_says_what_made_it(cache, gguf):
    folder = paths.converted_dir(gguf, "5.23.0", 2)
    assert folder == cache / "Tiny-Model.Q4_0-100-transformers-5.23.0-v2"
    assert paths.converted_dir(gguf, "5.2.0", 2) != folder


def test_models_does_not_import_eval():
    code = "import sys, h2okv.models; print([m for m in sys.modules if m.startswith('h2okv.eval')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_first_use_converts_once_then_reuses(cache, gguf, conversions, capsys):
    folder = conversion.ensure_converted(gguf)
    assert folder.parent == cache and (folder / "config.json").is_file()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "converting Tiny-Model.Q4_0.gguf once for transformers 5.23.0" in err[0]
    manifest = json.loads((folder / conversion.MANIFEST).read_text())
    assert manifest["key"] == {"format": conversion.FORMAT_VERSION, "gguf": gguf.name, "gguf_bytes": 100,
                               "transformers": "5.23.0"}
    assert conversion.ensure_converted(gguf) == folder
    assert len(conversions) == 1 and capsys.readouterr().err == ""
    assert entries(cache) == [folder.name]  # no temporary folder left behind


def test_another_transformers_version_gets_its_own_folder(cache, gguf, conversions, monkeypatch):
    older = conversion.ensure_converted(gguf)
    monkeypatch.setattr(conversion, "transformers_version", lambda: "5.24.0")
    newer = conversion.ensure_converted(gguf)
    assert newer != older and len(conversions) == 2 and made_by(newer) == 2
    assert "transformers-5.24.0" in newer.name


def test_manifest_from_another_version_is_converted_again(gguf, cache, conversions, capsys):
    folder = conversion.ensure_converted(gguf)
    manifest = json.loads((folder / conversion.MANIFEST).read_text())
    manifest["key"]["transformers"] = "5.2.0"  # a folder renamed or copied from another setup
    (folder / conversion.MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    assert conversion.trusted_folder(gguf) is None
    assert conversion.ensure_converted(gguf) == folder
    assert len(conversions) == 2 and made_by(folder) == 2
    assert "replacing" in capsys.readouterr().err
    assert conversion.trusted_folder(gguf) == folder
    assert entries(cache) == [folder.name]


@pytest.mark.parametrize("manifest", [None, "{not json", '["a list"]'])
def test_half_written_folder_is_not_trusted(gguf, cache, conversions, manifest):
    folder = conversion.converted_folder(gguf)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # what an old or interrupted writer may leave
    if manifest is not None:
        (folder / conversion.MANIFEST).write_text(manifest)
    assert conversion.trusted_folder(gguf) is None
    assert conversion.ensure_converted(gguf) == folder and made_by(folder) == 1


def test_interrupted_conversion_leaves_nothing_trusted(gguf, cache, conversions, monkeypatch):
    def interrupted(gguf, folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "write_plain_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conversion.ensure_converted(gguf)
    assert entries(cache) == []


def killed_leftovers(cache, folder):
    cache.mkdir()
    old, recent = cache / f".convert-{folder.name}-old", cache / f".convert-{folder.name}-live"
    for leftover in (old, recent):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"part")
    hours_ago = os.stat(old).st_mtime - conversion.ABANDONED_AFTER_S - 60
    os.utime(old, (hours_ago, hours_ago))
    return recent


def test_folders_of_a_killed_conversion_are_removed(gguf, cache, conversions):
    """The lock is ours, so no other conversion of the folder runs: every leftover is a killed one's."""
    folder = conversion.converted_folder(gguf)
    killed_leftovers(cache, folder)
    conversion.ensure_converted(gguf)
    assert entries(cache) == [folder.name]


def test_without_a_lock_only_old_leftovers_are_removed(gguf, cache, conversions, monkeypatch):
    """No fcntl (Windows): a recent temporary folder may be another process's live conversion."""
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` raises ImportError
    folder = conversion.converted_folder(gguf)
    recent = killed_leftovers(cache, folder)
    conversion.ensure_converted(gguf)
    assert entries(cache) == sorted([folder.name, recent.name])


def test_processes_convert_one_at_a_time(gguf, cache, conversions, monkeypatch, capsys):
    """A second conversion of the same folder waits for the first and then reuses its folder:
    two 1.5B conversions at once (~14 GB each) were killed for memory on a 24 GB machine."""
    fake, converting, release = conversion.write_plain_checkpoint, threading.Event(), threading.Event()

    def slow(gguf_path, tmp):
        fake(gguf_path, tmp)
        converting.set()  # the first holds the lock, mid-conversion
        assert release.wait(120)

    monkeypatch.setattr(conversion, "write_plain_checkpoint", slow)
    folders = []
    first = threading.Thread(target=lambda: folders.append(conversion.ensure_converted(gguf)))
    second = threading.Thread(target=lambda: folders.append(conversion.ensure_converted(gguf)))
    first.start()
    try:
        assert converting.wait(60)
        second.start()  # a file lock: two open()s of it conflict within one process as across two
        # the second says it waits (nothing else can be awaited: it blocks on the lock); the bound
        # is a safety net, and running out of it fails here rather than below
        said, deadline = "", time.monotonic() + 60
        while "waiting for another process" not in said:
            assert time.monotonic() < deadline, said
            time.sleep(0.01)
            said += capsys.readouterr().err
    finally:
        release.set()
        first.join(60), second.join(60)
    assert "waiting for another process converting Tiny-Model.Q4_0.gguf" in said
    assert len(conversions) == 1 and folders == [conversion.converted_folder(gguf)] * 2


def test_a_finished_conversion_from_another_process_is_kept(gguf, cache, conversions, monkeypatch):
    """Two processes convert at once: the second to finish keeps the first one's folder."""
    folder = conversion.converted_folder(gguf)
    real = conversion.write_plain_checkpoint  # the fake from `conversions`

    def racing(gguf_path, tmp):
        real(gguf_path, tmp)
        monkeypatch.setattr(conversion, "write_plain_checkpoint", real)
        # the other process (an h2okv without the lock), finishing first
        conversion._convert(gguf_path, folder, conversion.conversion_key(gguf_path), "none yet")

    monkeypatch.setattr(conversion, "write_plain_checkpoint", racing)
    assert conversion.ensure_converted(gguf) == folder
    assert made_by(folder) == 2 and entries(cache) == [folder.name]


def test_config_source_reads_the_gguf_until_converted(gguf, cache, conversions, monkeypatch):
    monkeypatch.setattr(paths, "default_gguf", lambda: gguf)
    assert models._config_source(None) == (str(gguf.parent), {"gguf_file": gguf.name})
    assert not cache.exists()  # reading a config converts nothing
    folder = conversion.ensure_converted(gguf)
    assert models._config_source(None) == (str(folder), {})
    assert models._source("smollm2") == (str(folder), {})


@pytest.mark.integration
def test_fresh_machine_tp_refusal_converts_nothing(cache, capsys):
    """An empty model cache: ``--tp`` checks need the config only, read from the GGUF's metadata,
    so the refusal is the one line on stderr (no conversion progress before it)."""
    config = models.load_config(None)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert cli.main(["generate", "--prompt", "hello", "--tp", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "h2okv: error: --tp 2: the default model (SmolLM2-135M-Instruct) has 3 KV heads, which do not "
        "divide by 2 (each rank holds whole heads); use --tp 1, 3"]
    assert not cache.exists()


@pytest.mark.integration
def test_default_model_converted_into_an_empty_cache_tokenizes_like_the_gguf(cache):
    """The real conversion round trip: the saved tokenizer, read back by this transformers, gives the
    GGUF's own token ids (the failure seen across versions put id 0 between words)."""
    from transformers import AutoTokenizer

    folder = Path(models.default_model_source())
    assert folder.parent == cache and conversion.trusted_folder(paths.default_gguf()) == folder
    gguf = paths.default_gguf()
    original = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    converted = AutoTokenizer.from_pretrained(folder)
    text = "To be, or not to be: that is the question."
    ids = converted(text, add_special_tokens=False)["input_ids"]
    assert ids == original(text, add_special_tokens=False)["input_ids"] and 0 not in ids
    assert converted.decode(ids) == text
    assert models.load_config(None).num_key_value_heads == 3


def rewrite(path, data, later_s=10):
    """Rewrite ``path`` in place, its modification time ``later_s`` past the old one (a user's edit)."""
    before = path.stat().st_mtime
    path.write_bytes(data)
    os.utime(path, (before + later_s, before + later_s))


def test_a_users_gguf_is_converted_once_and_again_when_the_file_changes(cache, gguf, conversions, capsys):
    """``--model my.gguf``: cached like the built-in models, and never served stale after an edit."""
    source, extra = models._source(str(gguf))
    folder = Path(source)
    assert extra == {} and made_by(folder) == 1 and folder.is_relative_to(cache / "user-gguf")
    assert "converting Tiny-Model.Q4_0.gguf once" in capsys.readouterr().err
    assert models._source(str(gguf)) == (source, {}) and len(conversions) == 1
    assert models._config_source(str(gguf)) == (source, {})
    manifest = json.loads((folder / conversion.MANIFEST).read_text())["key"]
    assert manifest["gguf_path"] == str(gguf.resolve()) and manifest["gguf_mtime_ns"] == gguf.stat().st_mtime_ns

    rewrite(gguf, b"GGUF" + bytes([1]) * 96)  # same name and size, new contents
    assert conversion.trusted_folder(gguf, user=True) is None
    assert models._source(str(gguf)) == (source, {}) and len(conversions) == 2 and made_by(folder) == 2
    assert "replacing" in capsys.readouterr().err

    rewrite(gguf, b"GGUF" + bytes(200))  # another size: another folder, the stale one removed
    bigger = Path(models._source(str(gguf))[0])
    assert bigger != folder and made_by(bigger) == 3
    assert entries(bigger.parent) == [bigger.name]


def test_same_named_user_ggufs_in_two_places_get_their_own_folders(cache, tmp_path, conversions):
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(96))
    one, two = models._source(str(first))[0], models._source(str(second))[0]
    assert one != two and len(conversions) == 2
    assert models._source(str(first))[0] == one and len(conversions) == 2


def test_a_users_gguf_config_is_read_from_the_file_until_converted(cache, gguf, conversions):
    assert models._config_source(str(gguf)) == (str(gguf.parent), {"gguf_file": gguf.name})
    assert not cache.exists() and conversions == []


def test_a_users_gguf_that_cannot_be_converted_is_a_one_line_error(cache, gguf, monkeypatch):
    def unsupported(gguf, folder):
        raise ValueError("GGUF model with architecture mystery is not supported yet.\nmore detail")

    monkeypatch.setattr(conversion, "write_plain_checkpoint", unsupported)
    with pytest.raises(H2OError, match="architecture mystery is not supported yet. more detail. Check that it is a"):
        models._source(str(gguf))
    assert list(cache.rglob("*.json")) == []  # nothing half-made is left to be trusted


@pytest.mark.integration
def test_a_users_real_gguf_is_converted_on_the_first_load_only(cache, tmp_path, capsys, monkeypatch):
    """The real conversion of a user's file (a copy of the default model's GGUF): the second load
    reads the saved checkpoint (no dequantization runs: counted, not timed, as a loaded machine
    may take 10 s to read 135M parameters) and gives the same tokens."""
    import shutil

    copy = tmp_path / "mine.gguf"
    shutil.copyfile(paths.default_gguf(), copy)
    model, tokenizer = models.load_model(str(copy), cache=False)
    assert "converting mine.gguf once" in capsys.readouterr().err
    dequantized, real = [], conversion.write_plain_checkpoint
    monkeypatch.setattr(conversion, "write_plain_checkpoint",
                        lambda *args: dequantized.append(args) or real(*args))
    again, tokenizer_again = models.load_model(str(copy), cache=False)
    assert capsys.readouterr().err.count("converting") == 0
    assert dequantized == []
    text = "To be, or not to be"
    assert tokenizer(text)["input_ids"] == tokenizer_again(text)["input_ids"]
    assert again.config.num_key_value_heads == model.config.num_key_value_heads == 3
