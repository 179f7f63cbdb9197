"""Skip marks for tests of a weight format this CPU cannot run.

The suite runs on AVX2-only x86 CPUs as well as AVX-512 and AMX ones: fp32, int8 and int4 run
everywhere (oneDNN fp32, aten's int ops), bf16 needs oneDNN's bf16 matmul (AVX-512 BW/VL/DQ or
AVX-NE-CONVERT) and q4k the GGUF panel kernels (AVX-512 VNNI and a C++ compiler). A test whose
point is not the format itself takes a format every CPU has instead of skipping.
"""

import functools

import pytest

from ssd_engine.layers.weight_formats import check_supported


@functools.cache
def missing(fmt: str) -> str | None:
    """Why this CPU cannot run weight format `fmt` (weight_formats.check_supported's line), None where it can."""
    try:
        check_supported(fmt, "the weight format")
    except ValueError as error:
        return str(error)
    return None


def needs(fmt: str) -> pytest.MarkDecorator:
    """Skip where this CPU lacks format `fmt`, naming what is missing."""
    return pytest.mark.skipif(missing(fmt) is not None, reason=missing(fmt) or "")


NEEDS_BF16 = needs("bf16")
NEEDS_Q4K = needs("q4k")
# the draft format of a test that runs a GPU's steps on this CPU (a GPU drafts in bf16; the int
# formats are CPU-only): bf16 where this CPU has it, else fp32, which takes the same paths
GPU_DRAFT_DTYPE_ON_CPU = "bf16" if missing("bf16") is None else "fp32"


def format_params(formats) -> list:
    """`formats` for a parametrize: those this CPU may lack (bf16, q4k) skip where it does."""
    return [
        pytest.param(fmt, marks=needs(fmt)) if fmt in ("bf16", "q4k") else fmt for fmt in formats
    ]
