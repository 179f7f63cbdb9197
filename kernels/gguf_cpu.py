"""The GGUF block kernels (SOURCES), compiled for this CPU on first use into the kernel cache under
a name keyed on the CPU's flags, the compiler flags and the sources, and registered as
torch.ops.ssd_engine_gguf: linear(x_fp32[rows, k], blocks_uint8[n, row_bytes], kind, k) -> [rows, n]
and friends. Where no compiler works, `load()` says why and the caller keeps fp32 weights."""

import functools
import hashlib
import os
import platform
from pathlib import Path
from typing import NamedTuple

from ssd_engine.utils import test_hooks

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "gguf_matmul.cpp",
        "gguf_int8.cpp",
        "gguf_pack.cpp",
        "gguf_panels_fp32.cpp",
        "gguf_vnni.cpp",
        "gguf_amx.cpp",
        "cpu_attention.cpp",
        "cpu_layer_ops.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("gguf_blocks.h", "gguf_panels.h", "gguf_int8_rows.h", "cpu_vec.h")
]  # part of the library's key
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers (AT_PARALLEL_OPENMP), which
# runs serially without it; the libgomp it links is the one torch has already loaded
MARCH_ENV = "SSD_ENGINE_KERNEL_MARCH"  # the compiler's -march (default native); part of FLAGS, so of library_key()
FLAGS = [
    "-O3",
    f"-march={os.environ.get(MARCH_ENV) or 'native'}",
    "-mprefer-vector-width=512",
    "-fno-math-errno",
    "-fopenmp",
]


class BlockShape(NamedTuple):
    values: int  # weights a block holds
    bytes: int  # its size
    half_offsets: tuple  # where its fp16 scales (and minimums) lie


# GGML type id -> its block; the kernel handles exactly these
BLOCKS = {
    2: BlockShape(32, 18, (0,)),
    3: BlockShape(32, 20, (0, 2)),
    6: BlockShape(32, 22, (0,)),
    7: BlockShape(32, 24, (0, 2)),
    8: BlockShape(32, 34, (0,)),
    12: BlockShape(256, 144, (0, 2)),
    13: BlockShape(256, 176, (0, 2)),
    14: BlockShape(256, 210, (208,)),
}

INT8_KINDS = (2, 3, 8, 12, 14)  # Q4_0, Q4_1, Q8_0, Q4_K, Q6_K: gguf_int8.cpp's
PANEL_KINDS = (12, 14)  # Q4_K, Q6_K: the kinds pack_panels repacks


class KernelUnavailable(RuntimeError):
    """The GGUF kernels cannot be built or loaded here (the message says why, in one line)."""


def _cpu_key() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def library_key() -> str:
    """What the built library depends on: the CPU's flags, the sources, the flags, torch's version."""
    import torch

    digest = hashlib.sha256(f"{_cpu_key()} {FLAGS} {torch.__version__}".encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def load() -> None:
    """Build (once per machine and source) and load the kernels; KernelUnavailable if that fails.
    Builds hold an OS file lock, which a killed builder releases (torch's lock file outlives it)."""
    if test_hooks.gguf_kernel_switched_off():
        raise KernelUnavailable(
            f"the GGUF kernels are switched off ({test_hooks.NO_GGUF_KERNEL}=1)"
        )
    import torch
    from filelock import FileLock

    from ssd_engine.utils.cache import kernel_cache_dir

    name = f"ssd_engine_gguf_{library_key()}"
    folder = kernel_cache_dir() / name
    library = folder / f"{name}.so"
    try:
        if not library.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            with FileLock(str(folder.parent / f".{name}.lock")):
                if not library.is_file():
                    _build(name, folder)
        torch.ops.load_library(str(library))
        torch.ops.ssd_engine_gguf.linear  # noqa: B018  raises now if the library registered nothing
        _register_output_shapes()
    except Exception as error:  # no compiler, no ninja, a compile error: all mean "not here"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise KernelUnavailable(f"cannot build the GGUF CPU kernels: {first}") from None


@functools.cache
def _register_output_shapes() -> None:
    """What the products return, for torch.compile (`compile_model`), which traces a step with
    tensors that hold no data: without it a compiled GGUF target fails at its first Linear."""
    import torch

    for name in ("linear", "linear_int8"):  # a block row per output
        torch.library.register_fake(f"ssd_engine_gguf::{name}")(
            lambda x, blocks, kind, k: x.new_empty(x.shape[0], blocks.shape[0])
        )
    for name in ("linear_panels", "linear_int8_panels"):  # n outputs, named
        torch.library.register_fake(f"ssd_engine_gguf::{name}")(
            lambda x, panels, kind, k, n: x.new_empty(x.shape[0], n)
        )


def _build(name: str, folder: Path) -> None:
    from torch.utils import cpp_extension

    # torch's build lock, left by a builder that was killed
    (folder / "lock").unlink(missing_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )


def available() -> bool:
    try:
        load()
    except KernelUnavailable:
        return False
    return True


def panels_available(int8_activations: bool) -> bool:
    """Whether this CPU runs Q4_K / Q6_K from panels: gguf (fp32 rows) needs AVX-512, gguf-int8 VNNI."""
    import torch

    if not available():
        return False
    ops = torch.ops.ssd_engine_gguf
    return ops.panels_int8_available() if int8_activations else ops.panels_fp32_available()
