"""transformers' greedy continuations: the oracle every greedy test compares against.

`greedy(path, prompts, max_new_tokens)` runs `generate` (fp32, EOS ignored) once per checkpoint,
prompts, length and device in a session: remembered in the process and, through the folder
tests/conftest.py sets as `shared_dir`, by every xdist worker (a worker's tiny checkpoints live in
its own folder, so a checkpoint is known by its bytes, not its path). `generate` costs ~20 ms a
token on a tiny model, and a dozen test files ask for the same continuations.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

shared_dir: Path | None = None  # one folder for the session's workers (tests/conftest.py)
_remembered: dict[str, list[list[int]]] = {}
_digests: dict[tuple, str] = {}
WHOLE_FILE_BYTES = (
    64 << 20
)  # larger weight files (a real checkpoint) are known by their size and head


def greedy(
    path: str, prompts: list[list[int]], max_new_tokens: int, device: torch.device | str = "cpu"
) -> list[list[int]]:
    key = hashlib.sha256(
        json.dumps(
            [_checkpoint_digest(path), [list(p) for p in prompts], max_new_tokens, str(device)]
        ).encode()
    ).hexdigest()[:32]
    if key not in _remembered:
        _remembered[key] = _shared(key, lambda: _generate(path, prompts, max_new_tokens, device))
    return [list(tokens) for tokens in _remembered[key]]


def _shared(key: str, compute) -> list[list[int]]:
    if shared_dir is None:
        return compute()
    file = shared_dir / f"{key}.json"
    if file.is_file():
        return json.loads(file.read_text())
    outs = compute()  # two workers may both compute it: the same tokens, written whole either way
    shared_dir.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(outs))
    partial.replace(file)
    return outs


def _checkpoint_digest(path: str) -> str:
    """The checkpoint's bytes, hashed once per process while its files stay as they are."""
    files = [
        Path(path, name)
        for name in sorted(os.listdir(path))
        if name.endswith((".json", ".safetensors"))
    ]
    listing = (path, *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if listing not in _digests:
        digest = hashlib.sha256()
        for file in files:
            digest.update(f"{file.name} {file.stat().st_size}".encode())
            with open(file, "rb") as f:
                digest.update(f.read(WHOLE_FILE_BYTES))
        _digests[listing] = digest.hexdigest()
    return _digests[listing]


def _generate(path: str, prompts: list[list[int]], max_new_tokens: int, device) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    return [
        model.generate(
            torch.tensor([p], device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
