"""Independent random streams, one per use, derived from one seed. Exact verification needs the
draft's tokens independent of the verifier's uniforms, so every generator is seeded with a hash of
(seed, stream, salt...), never with the user's number. The salt separates generators of one stream
that must not repeat each other (a re-learned sequence, each process's BACKUP)."""

from __future__ import annotations

import enum
import hashlib

import torch


class Stream(enum.Enum):
    """TARGET: target sampling, acceptance uniforms and residual / bonus draws (one generator,
    fixed order); DRAFT: draft token sampling; BACKUP: the fast backup's proposals; SYNTHETIC:
    benchmarking draws, kept apart so those options never shift a request's streams."""

    TARGET = "target"
    DRAFT = "draft"
    BACKUP = "backup"
    SYNTHETIC = "synthetic"


def stream_seed(seed: int, stream: Stream, *salt: int | str) -> int:
    """A 63-bit seed for `stream`, unrelated to the seed of any other (stream, salt)."""
    key = repr((int(seed), stream.value) + tuple(salt)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def stream_generator(
    seed: int, stream: Stream, *salt: int | str, device: torch.device | str = "cpu"
) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(stream_seed(seed, stream, *salt))
