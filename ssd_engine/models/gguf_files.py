"""A GGUF file given as `model=` / `draft_model=`: converted once, like the built-in pair, into a
cache folder keyed by the file's path, size and mtime. Standard library only at module level."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ssd_engine.models.default_models import (
    MARKER,
    _resolve_cached,
    cache_dir,
    discard,
    is_complete,
)
from ssd_engine.utils.progress import progress_enabled

GGUF_MAGIC = b"GGUF"
GGUF_PREFIX = "gguf-"  # cache folders of users' GGUF files: gguf-<file stem>-<key>
KEY_CHARS = 16


def is_gguf_file(path) -> bool:
    """An existing file that starts with GGUF's magic bytes (whatever its name ends with)."""
    try:
        with open(path, "rb") as f:
            return os.path.isfile(path) and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_cache_name(path) -> str:
    """The cache folder of a user's GGUF file: its name plus a key of (absolute path, size, mtime),
    so a file replaced in place converts again without hashing its content."""
    source = Path(path).resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()[
        :KEY_CHARS
    ]
    stem = re.sub(r"[^a-z0-9._-]+", "-", source.stem.lower()).strip("-.") or "model"
    return f"{GGUF_PREFIX}{stem}-{key}"


def gguf_cache_folder(path) -> Path:
    """Where a user's GGUF file is (or will be) converted; is_complete() of it is a cache hit."""
    return cache_dir() / gguf_cache_name(path)


def resolve_gguf(path) -> str:
    """Path of the converted HF folder for a user's GGUF file, converted once into cache_dir()."""
    source = Path(path).resolve()
    name = gguf_cache_name(source)

    def make_gguf(root: Path) -> Path:
        _drop_superseded(root, source, name)  # converted from this path before it changed
        return (
            source  # converted straight from where it lies: no copy, never deleted (cleanup=False)
        )

    return _resolve_cached(name, make_gguf, cleanup=False)


def _drop_superseded(root: Path, source: Path, keep: str) -> None:
    """Remove earlier conversions of the same path (since changed): nothing will look them up."""
    stem = keep[: -KEY_CHARS - 1]  # the name less "-<key>"
    for folder in root.glob(f"{stem}-*"):
        if folder.name == keep or len(folder.name) != len(keep) or not is_complete(folder):
            continue
        try:
            info = json.loads((folder / MARKER).read_text())
        except (OSError, ValueError):
            continue
        if info.get("path") == str(source):
            discard(folder)


def source_gguf(folder) -> Path:
    """The GGUF file a converted folder came from: a user's file where it lies, the built-in pair's
    joined again from its installed parts into the folder, once. ValueError (one line) otherwise."""
    from ssd_engine.models.default_models import DEFAULT_DRAFT, DEFAULT_TARGET, join_parts

    folder = Path(folder)
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        info = {}
    info = info if isinstance(info, dict) else {}
    if info.get("path") and is_gguf_file(info["path"]):
        return Path(info["path"])
    for model_spec in (DEFAULT_TARGET, DEFAULT_DRAFT):
        # the marker names the file converted: a folder standing in under the same name is not it
        if (
            folder.name == model_spec.name
            and is_complete(folder)
            and info.get("source") == model_spec.gguf_name
        ):
            joined = folder / model_spec.gguf_name  # appears only by an atomic rename, verified
            if not joined.is_file():
                from filelock import FileLock

                with FileLock(str(folder.parent / f".{folder.name}.lock")):
                    if not joined.is_file():
                        join_parts(model_spec, joined, progress=progress_enabled())
            return joined
    raise ValueError(
        f"target_dtype=gguf needs the GGUF file {folder} was converted from, and none is known "
        f"(give the .gguf file itself as the model)"
    )
