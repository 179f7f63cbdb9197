"""The draft's weight formats (layers/weight_formats.py) and how one is picked (planning/formats.py)."""

import json
import os

import pytest
import torch
from cpu_features import format_params
from transformers import Qwen2Config

from ssd_engine.core.config import EngineConfig
from ssd_engine.layers import weight_formats
from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE, FORMATS, dequantized, prepare
from ssd_engine.planning import formats, probe_cache
from ssd_engine.planning.formats import DraftFormat, linear_shapes
from ssd_engine.planning.formats import choose_draft as choose


def resolve(option, hf_config, device, workload, cores, threads, cache):
    """The draft format resolved with the model cache at `cache`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            probe_cache, "cache_dir", lambda: cache
        )  # the probes' folder alone (kernels stay cached)
        return formats.resolve_draft(option, hf_config, device, workload, cores, threads)


# worst output error against x @ w.T for unit-variance x and weights of std 0.05 over 256 columns
# (output std 0.8): bf16 rounding of x and w (~2^-8 relative each), int8's 1/254 of the row range,
# int4's 1/30 of a 32-column group's range (q4k's too, its scales rounded to 6 bits)
TOLERANCE = {"fp32": 1e-4, "bf16": 0.03, "int8": 0.06, "int4": 0.5, "q4k": 0.5}


@pytest.mark.parametrize("fmt", format_params(FORMATS))
@pytest.mark.parametrize("rows", [1, 5])
def test_each_format_multiplies_by_its_dequantized_weight(fmt, rows):
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 256, generator=g) * 0.05, torch.randn(rows, 256, generator=g)
    bias = torch.randn(96, generator=g)
    out = prepare(weight, fmt)(x.to(ACTIVATION_DTYPE[fmt]), bias).float()
    assert out.shape == (rows, 96)
    # what the format computes: its own weight, rounded activations, output in the activations' dtype
    own = x.to(ACTIVATION_DTYPE[fmt]).float() @ dequantized(weight, fmt).t() + bias
    assert (out - own).abs().max() < 0.05 + (1e-4 if fmt == "fp32" else 0)
    assert (out - (x @ weight.t() + bias)).abs().max() < TOLERANCE[fmt]
    if fmt in ("int8", "int4", "q4k"):  # really quantized: the weight differs from the fp32 one
        assert (dequantized(weight, fmt) - weight).abs().max() > 1e-4


@pytest.mark.parametrize("shape", [(16, 48), (8, 64)])
def test_int4_takes_int8_where_its_layout_does_not_tile(shape):
    assert type(prepare(torch.randn(*shape), "int4")).__name__ == "Int8Weight"
    assert type(prepare(torch.randn(16, 64), "int4")).__name__ == "Int4Weight"


def test_choose_prefers_precision_within_the_tie_margin():
    assert choose({"fp32": 10.0, "bf16": 5.0, "int8": 4.0, "int4": 2.0}) == "int4"
    assert choose({"fp32": 10.0, "bf16": 2.1, "int8": 4.0, "int4": 2.0}) == "bf16"  # within 10%
    assert choose({"fp32": 1.0, "bf16": 1.05}) == "fp32"


def _tiny_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def test_linear_shapes_follow_the_config():
    shapes = linear_shapes(_tiny_config())
    assert shapes == [(64 + 2 * 32, 64, 2), (64, 64, 2), (256, 64, 2), (64, 128, 2), (512, 64, 1)]


def test_auto_probes_once_then_reads_the_cache(tmp_path, monkeypatch):
    probes = []
    real_probe = formats.probe_draft
    monkeypatch.setattr(formats, "probe_draft", lambda *a: probes.append(a) or real_probe(*a))
    first = resolve("auto", _tiny_config(), "cpu", [(1, 2)], None, 1, str(tmp_path))
    assert (
        first.how == "probe"
        and set(first.step_ms) <= set(FORMATS)
        and first.name == choose(first.step_ms)
    )
    again = resolve("auto", _tiny_config(), "cpu", [(1, 2)], None, 1, str(tmp_path))
    assert again == DraftFormat(first.name, "cached probe", first.step_ms) and len(probes) == 1
    other_workload = resolve("auto", _tiny_config(), "cpu", [(8, 2)], None, 1, str(tmp_path))
    assert other_workload.how == "probe" and len(probes) == 2
    (cached,) = [
        f
        for f in os.listdir(tmp_path / "probes")
        if json.load(open(tmp_path / "probes" / f))["workload"] == [[1, 2]]
    ]
    assert cached.startswith("draft-format-")


def test_the_probe_skips_a_format_this_cpu_lacks(tmp_path, monkeypatch):
    # as bf16 does on an AVX2-only CPU: oneDNN refuses to pack it (a RuntimeError)
    real_prepare = formats.prepare

    def prepare_without_bf16(weight, fmt):
        if fmt == "bf16":
            raise RuntimeError(
                "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw"
            )
        return real_prepare(weight, fmt)

    monkeypatch.setattr(formats, "prepare", prepare_without_bf16)
    chosen = resolve("auto", _tiny_config(), "cpu", [(1, 2)], None, 1, str(tmp_path))
    assert "bf16" not in chosen.step_ms and {"fp32", "int8", "int4"} <= set(chosen.step_ms)
    assert chosen.name != "bf16"


def test_an_explicit_format_is_taken_without_a_probe(tmp_path):
    chosen = resolve("int8", _tiny_config(), "cpu", [(1, 2)], None, 1, str(tmp_path))
    assert chosen == DraftFormat("int8", "draft_dtype") and chosen.dtype == "bfloat16"
    assert (
        resolve("fp32", _tiny_config(), "cpu", [(1, 2)], None, 1, str(tmp_path)).dtype == "float32"
    )
    assert (
        resolve("auto", _tiny_config(), "cuda:0", [(1, 2)], None, 1, str(tmp_path)).name == "bf16"
    )
    assert not (tmp_path / "probes").exists()


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(draft_dtype="fp16"), "draft_dtype must be one of"),
        (dict(draft_dtype="int4", device="cuda"), "CPU-only"),
    ],
)
def test_bad_draft_dtype_is_one_clear_error(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineConfig.from_kwargs(**options)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantizing_in_row_chunks_gives_the_whole_matrix_layout(fmt, monkeypatch):
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(208, 64, generator=g) * 0.05, torch.randn(3, 64, generator=g).bfloat16()
    whole = prepare(weight, fmt)(x, None)
    monkeypatch.setattr(weight_formats, "CHUNK_ROWS", 64)  # 64, 128, 192 and a 16-row tail
    assert torch.equal(prepare(weight, fmt)(x, None), whole)
