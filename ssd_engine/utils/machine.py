"""This CPU's model, its kernel-relevant flags, and fingerprints that key cached measurements."""

import functools
import hashlib
import os
import platform

# flags that change which weight formats and matmul paths are fast
KERNEL_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    try:
        with open("/proc/cpuinfo") as f:
            fields = {}
            for line in f:
                if not line.strip():
                    break  # the first processor's block describes them all
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
            return fields
    except OSError:
        return {}


def cpu_model() -> str:
    return (
        _cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown cpu"
    )


def cpu_flags() -> list[str]:
    """The kernel-relevant flags this CPU has (a subset of KERNEL_FLAGS, in that order)."""
    present = set(_cpuinfo().get("flags", "").split())
    return [flag for flag in KERNEL_FLAGS if flag in present]


def describe() -> dict:
    """For result files: what the numbers next to it were measured on."""
    import torch

    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "visible_cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def cpu_fingerprint() -> str:
    """A short key for this kind of CPU (model, flags) under this torch, whatever cores are used."""
    import torch

    key = "|".join([cpu_model(), ",".join(cpu_flags()), torch.__version__])
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def fingerprint(cores: list[int] | None, threads: int) -> str:
    """A short key for measurements made on these cores with this many threads on this machine."""
    import torch

    key = "|".join(
        [
            cpu_model(),
            ",".join(cpu_flags()),
            torch.__version__,
            str(len(cores) if cores else os.cpu_count()),
            str(threads),
        ]
    )
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
