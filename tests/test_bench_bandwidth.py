"""benchmarks/gpu/bench_bandwidth.py: its byte model equals a hand count from the tiny configs (weights
read once per step whatever the CPU layout, a tied table once, only the looked-up embedding rows,
KV per sequence), the datasheet table, and an end-to-end run writing a table of positive numbers."""

import re

import pytest
from gpu import bench_bandwidth
from runners import tiny_runner

from ssd_engine.runtime.model_runner import ModelRunner

# tiny configs (tests/tiny_checkpoints.py): vocab 320, hidden 64, intermediate 128, 2 layers,
# 4 heads, 2 KV heads, head_dim 16, fp32
QKV = (64 + 2 * 32) * 64  # fused q, k, v rows x hidden
O_PROJ, GATE_UP, DOWN = 64 * 64, 2 * 128 * 64, 64 * 128
NORMS = 2 * 64  # input and post-attention RMSNorm
LAYER = QKV + O_PROJ + GATE_UP + DOWN + NORMS
TABLE = 320 * 64  # the LM head (or the tied embedding table)


def runner(path: str, layout: str) -> ModelRunner:
    return tiny_runner(path, num_kv_blocks=8, block_size=16, max_position=64, weight_layout=layout)


@pytest.mark.parametrize("layout", ["plain", "dual", "packed"])
def test_untied_qwen2_bytes_by_hand(tiny_qwen2, layout):
    batch, context = 3, 40
    weights, kv = bench_bandwidth.step_bytes(runner(tiny_qwen2, layout), batch, context)
    # qwen2: q/k/v bias; final norm; untied LM head read whole; 3 embedding rows
    expected = 2 * (LAYER + 128) + 64 + TABLE + batch * 64
    assert weights == 4 * expected == 379904  # the same under every layout: one copy is read
    assert kv == batch * 2 * 2 * 2 * 16 * (context + 1) * 4 == 62976


def test_tied_llama_table_counted_once(tiny_llama):
    r = runner(tiny_llama, "dual")
    assert r.model.lm_head.weight is r.model.model.embed_tokens.weight  # the fixture is tied
    weights, kv = bench_bandwidth.step_bytes(r, 1, 15)
    assert (
        weights == 4 * (2 * LAYER + 64 + TABLE + 64) == 378368
    )  # table once (as the head) + 1 row
    assert kv == 2 * 2 * 2 * 16 * 16 * 4 == 8192
    resident = sum(
        p.numel() * 4 for p in r.model.parameters()
    )  # parameters() counts a shared tensor once
    assert weights == resident + 4 * 64


def test_datasheet_peaks():
    peak = bench_bandwidth.peak_bytes_per_s
    assert peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak("NVIDIA H100 PCIe") == 2.0e12
    assert peak("NVIDIA H200") == 4.8e12
    assert peak("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert peak("NVIDIA A100-SXM4-40GB") is None and peak("Tesla T4") is None


def test_end_to_end_table(tiny_qwen2, tiny_llama, tmp_path):
    out = tmp_path / "bw.md"
    bench_bandwidth.main(
        [
            "--model",
            tiny_qwen2,
            "--draft",
            tiny_llama,
            "--batch",
            "1,2",
            "--context",
            "20",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--ceiling-gib",
            "0.0625",
            "--out",
            str(out),
        ]
    )
    text = out.read_text()
    assert (
        "python benchmarks/gpu/bench_bandwidth.py --model" in text and "1 torch thread(s)" in text
    )
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| model") or line.startswith("| draft")
    ]
    assert len(rows) == 5  # header + 2 models x 2 batch sizes
    kv_per_token = 2 * 2 * 2 * 16 * 4
    for line, batch, weights in zip(
        rows[1:], (1, 2, 1, 2), (379904 - 512, 379904 - 256, 378368, 378368 + 256)
    ):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == "float32" and cells[2] == str(batch) and cells[3] == "20"
        total = weights + batch * 21 * kv_per_token
        assert float(cells[4]) == round(total / 1e6, 1) and float(cells[5]) == round(
            batch * 21 * kv_per_token / 1e6, 1
        )
        step_ms, achieved, ceiling = float(cells[6]), float(cells[7]), float(cells[8])
        assert (
            step_ms > 0 and achieved >= 0 and ceiling > 0
        )  # a slow step of a tiny model rounds to 0.0 GB/s
        assert achieved == pytest.approx(
            total / (step_ms / 1e3) / 1e9, rel=0.06, abs=0.06
        )  # rounded cells
        assert re.fullmatch(r"\d+%", cells[9]) and cells[10] == "n/a"  # no datasheet peak on CPU
        assert cells[11] == "n/a"  # GPU kernels are counted on a GPU only


def test_the_step_profile_lists_the_costliest_kernels_first():
    """The per-kernel table a GPU run writes (here from CPU profiler events, the same event type):
    grouped by name, the most time first, launches counted, and a sum row."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a @ a
        torch.relu(a)
    events = [e for e in prof.events() if e.name in ("aten::mm", "aten::relu")]
    rows = bench_bandwidth.kernel_profile(events)
    assert rows[0].startswith("| `aten::mm` | 3 |") and rows[1].startswith("| `aten::relu` | 1 |")
    assert rows[-1].startswith(f"| all {len(events)} | {len(events)} |") and rows[-1].endswith(
        "| 100% |"
    )
