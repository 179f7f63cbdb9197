"""Padding oneDNN's one- and two-row matmuls to a faster row count (layers/row_padding.py), measured
before any model is built (planning/row_padding_probe.py)."""

import os
from dataclasses import replace

import pytest
import torch
from cpu_features import NEEDS_BF16
from runners import runner_spec
from test_greedy_generation import GREEDY, _prompts, oracle_outputs  # noqa: F401 (fixture)

from ssd_engine import LLM
from ssd_engine.layers import row_padding
from ssd_engine.layers.weight_formats import prepare
from ssd_engine.planning import probe_cache, row_padding_probe


def test_choose_pads_only_to_a_clearly_faster_row_count():
    assert row_padding_probe.choose_padding({1: 7.0, 2: 7.8, 3: 5.7, 4: 4.9}) == {
        1: 4,
        2: 4,
    }  # 3 -> 4 saves only 14%
    assert row_padding_probe.choose_padding({1: 2.0, 2: 2.1, 3: 2.2, 4: 2.3}) == {}
    assert (
        row_padding_probe.choose_padding({1: 4.0, 2: 4.1, 3: 3.6, 4: 4.5}) == {}
    )  # 10% is within the noise margin


@pytest.fixture
def padded(monkeypatch):
    monkeypatch.setitem(row_padding._padded, torch.float32, {1: 4, 2: 4, 3: 4})
    monkeypatch.setitem(row_padding._padded, torch.bfloat16, {1: 4, 2: 4, 3: 4})


@pytest.mark.parametrize("fmt", ["fp32", pytest.param("bf16", marks=NEEDS_BF16)])
def test_padded_rows_give_the_rows_asked_for(padded, fmt):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    x = torch.randn(4, 64, generator=g).to(torch.float32 if fmt == "fp32" else torch.bfloat16)
    prepared = prepare(weight, fmt)
    full = prepared(x, bias)  # four rows: no padding
    for rows in (1, 2, 3):
        out = prepared(x[:rows], bias)
        assert out.shape == (rows, 48)
        torch.testing.assert_close(
            out.float(), full[:rows].float(), rtol=0, atol=1e-5 if fmt == "fp32" else 2e-2
        )


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_stays_exact_with_padded_decode_steps(tiny_model_dir, oracle_outputs, padded, arch):
    with LLM(tiny_model_dir(arch), block_size=8) as llm:
        outputs = llm.generate(_prompts(3), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == oracle_outputs(arch, 3)


def test_a_dtype_onednn_cannot_pack_pads_nothing_and_is_cached(tmp_path, monkeypatch):
    # bf16 on a CPU without AVX-512: oneDNN's reorder raises, so no weight of it is packed either
    probes = []

    def refuse(dtype):
        probes.append(dtype)
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(row_padding_probe, "_probe_padding", refuse)
    monkeypatch.setattr(probe_cache, "cache_dir", lambda: str(tmp_path))
    cores = sorted(os.sched_getaffinity(0))
    assert row_padding_probe.measure_row_padding(torch.bfloat16, cores, 1) == {}
    assert (
        row_padding_probe.measure_row_padding(torch.bfloat16, cores, 1) == {} and len(probes) == 1
    )  # the cache answers
    monkeypatch.setattr(row_padding, "_padded", {})
    row_padding.install(torch.bfloat16, {})
    assert (
        row_padding.padded_rows(1, torch.bfloat16) == 1
        and row_padding.largest_padded(torch.bfloat16) == 0
    )


@pytest.mark.parametrize(
    "fields, probed",
    [
        (dict(weight_format="int8"), None),
        (dict(weight_format="int4"), None),
        pytest.param(dict(weight_format="bf16"), torch.bfloat16, marks=NEEDS_BF16),
        (dict(weight_layout="packed"), torch.float32),
        (dict(weight_layout="plain"), None),
    ],
)
def test_the_plan_measures_only_the_onednn_dtype_a_runner_packs_and_the_runner_only_installs_it(
    tiny_model_dir, monkeypatch, fields, probed
):
    # an int8 / int4 draft runs bf16 activations through aten's int ops, never oneDNN's bf16 matmul
    measured = []
    monkeypatch.setattr(
        row_padding_probe,
        "measure_row_padding",
        lambda dtype, cores, threads: measured.append(dtype) or {1: 4},
    )
    monkeypatch.setattr(row_padding, "_padded", {})
    dtype = "bfloat16" if "weight_format" in fields else "float32"
    model = replace(
        runner_spec(tiny_model_dir("qwen2"), num_kv_blocks=4, block_size=8, max_position=32).model,
        dtype=dtype,
        **fields,
    )
    planned = row_padding_probe.with_row_padding(model, sorted(os.sched_getaffinity(0)), 1)
    assert measured == ([probed] if probed else []) and planned.row_padding == (
        ((1, 4),) if probed else ()
    )
    monkeypatch.setattr(
        row_padding_probe, "measure_row_padding", lambda *a: pytest.fail("a runner measured")
    )
    runner = replace(
        runner_spec(tiny_model_dir("qwen2"), num_kv_blocks=4, block_size=8, max_position=32),
        model=planned,
    ).build()
    assert runner.model is not None and row_padding._padded == ({probed: {1: 4}} if probed else {})
