"""Micro-benchmark (not a test): the GGUF block kernels (kernels/gguf_matmul.cpp, gguf_int8.cpp, gguf_vnni.cpp) against
oneDNN's packed fp32 weight, one decoder layer of the 1.5B target at a time, by row count.

    python benchmarks/micro/bench_gguf_kernels.py            # 1 and 2 threads
    python benchmarks/micro/bench_gguf_kernels.py --threads 2

The layer's seven Linears at Qwen2.5-1.5B's shapes, fused as the engine runs them (qkv 2048 x 1536
and gate_up 17920 x 1536 in Q4_K, o 1536 x 1536 in Q4_K, down 1536 x 8960 in Q6_K: the Q4_K_M mix of
half the layers), random blocks with small scales. Milliseconds per layer (best of 3 means of 10
calls) and each row count's cost against one row: what speculation's K + 1 verification rows cost.
Each call runs `--layers` copies of the layer (8: ~200 MB of Q4_K_M), so the weights stream from
memory as a whole model's do; one layer (~26 MB) stays in this VM's L3 and flatters every kernel.
"""

import argparse
import time

import torch
from ssd_engine.kernels import gguf_cpu

from ssd_engine.layers.gguf_weight import random_rows
from ssd_engine.layers.weight_formats import prepare

LAYER = [
    (2048, 1536, 12),
    (1536, 1536, 12),
    (17920, 1536, 12),
    (1536, 8960, 14),
]  # (out, in, GGML type)
ROWS = (1, 2, 5, 8)


def timed(call, reps: int = 10) -> float:
    call()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument(
        "--layers", type=int, default=8, help="copies of the layer a call runs (default 8)"
    )
    args = parser.parse_args()
    gguf_cpu.load()
    ops = torch.ops.ssd_engine_gguf
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER * args.layers
    blocks = [random_rows(n, k, kind, generator) for n, k, kind in shapes]
    dense = [
        prepare(torch.randn(n, k, generator=generator) * 0.02, "fp32", row_independent=True)
        for n, k, _ in shapes
    ]
    panels = [ops.pack_panels(b.blocks, b.kind, b.cols) for b in blocks]
    columns = {"fp32": "fp32 oneDNN", "gguf": "gguf blocks", "int8": "gguf-int8 blocks"}
    if ops.panels_fp32_available():
        columns["panels"] = "gguf panels (AVX-512)"
    if ops.panels_int8_available():
        columns["int8 panels"] = "gguf-int8 panels (VNNI)"
    print(
        "| threads | rows | "
        + " | ".join(f"{name} ms (x 1 row)" for name in columns.values())
        + " |"
    )
    print("|---|---|" + "---|" * len(columns))
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        base = {}
        for rows in ROWS:
            xs = [torch.randn(rows, k, generator=generator) for _, k, _ in shapes]
            cells = {
                "fp32": timed(lambda: [w(x, None) for w, x in zip(dense, xs)]),
                "gguf": timed(
                    lambda: [ops.linear(x, b.blocks, b.kind, b.cols) for b, x in zip(blocks, xs)]
                ),
                "int8": timed(
                    lambda: [
                        ops.linear_int8(x, b.blocks, b.kind, b.cols) for b, x in zip(blocks, xs)
                    ]
                ),
            }
            for column, linear in (
                ("panels", ops.linear_panels),
                ("int8 panels", ops.linear_int8_panels),
            ):
                if column in columns:
                    cells[column] = timed(
                        lambda: [
                            linear(x, p, b.kind, b.cols, b.rows)
                            for b, p, x in zip(blocks, panels, xs)
                        ]
                    )
            cells = {c: ms / args.layers for c, ms in cells.items()}  # a call ran every copy
            base = base or cells
            print(
                f"| {threads} | {rows} | "
                + " | ".join(f"{cells[c]:.2f} ({cells[c] / base[c]:.2f}x)" for c in columns)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
