"""Independent random streams, one per use, derived from one seed.

Exactness of speculative verification needs the draft's tokens to be independent of the
verifier's uniforms (given the tokens emitted so far). If the draft and the target seeded their
generators with the same number, the draft's sample x = F_q^-1(u) and the acceptance test
u' < p(x) / q(x) would read the same u and the output law would be wrong. So nothing seeds a
generator with a user's number directly: every generator is seeded with a hash of
(seed, stream, salt...), which gives unrelated Mersenne-Twister states for different streams.

Streams:
- TARGET: the target's sampling, the verifier's acceptance uniforms and its residual / bonus
  draws (drawn from one generator in a fixed order, see sampling/rejection.py);
- DRAFT: the draft's token sampling (SD's colocated draft; the SSD draft process's cached
  branches and just-in-time drafts);
- BACKUP: the fast backup's random proposals (SSD draft process, or the coordinator's local
  speculator after a draft failure);
- SYNTHETIC: benchmarking only, the draws that stand in for acceptance and cache hits
  (sampling/synthetic.py), so those options never shift a request's streams.

The salt separates generators of one stream that must not repeat each other: the SSD draft
process salts with the sequence's token count when it (re)learns a sequence, so a sequence
that comes back after preemption does not replay draft randomness that already shaped its
emitted tokens, and the two processes salt their BACKUP streams differently.
"""
from __future__ import annotations

import enum
import hashlib

import torch


class Stream(enum.Enum):
    TARGET = "target"
    DRAFT = "draft"
    BACKUP = "backup"
    SYNTHETIC = "synthetic"


def stream_seed(seed: int, stream: Stream, *salt: int | str) -> int:
    """A 63-bit seed for `stream`, unrelated to the seed of any other (stream, salt)."""
    key = repr((int(seed), stream.value) + tuple(salt)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def stream_generator(seed: int, stream: Stream, *salt: int | str,
                     device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(stream_seed(seed, stream, *salt))
