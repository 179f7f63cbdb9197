"""A decode step's four matmuls a layer, as the engine launches them today (cuBLAS GEMMs between the
Triton norm and SiLU kernels: 7 launches, split-K's reduce aside) against kernels/skinny_matmul.py's
(norm in the prologue, SiLU-mul and the residual add in the epilogue: 4 launches), at a model's
shapes, graphed as a decode step replays them. (Not a test.)

    python benchmarks/gpu/bench_skinny.py --model configs/shapes/qwen2.5-coder-1.5b-instruct --out benchmarks/results/DATE-skinny.md

Random bf16 weights, one copy per layer (a step streams each layer's from HBM, not from L2). First each op
alone: every tile configuration below, `layers` launches a graph, against cuBLAS's GEMM of the same
operands; then the whole chain for all layers with each op's fastest configuration, at 1 row (decode)
and 5 (K = 4 verification). Each fused op is checked against the unfused ops before it is timed. The
ceiling is a device copy's (read + written bytes) / time."""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from ssd_engine.kernels.fused_layer_ops import add_rms_norm, silu_mul  # noqa: E402
from ssd_engine.kernels.skinny_matmul import SkinnyConfig, skinny_linear  # noqa: E402

CONFIGS = [SkinnyConfig(16, 128), SkinnyConfig(16, 256), SkinnyConfig(32, 128), SkinnyConfig(32, 256),
           SkinnyConfig(64, 128), SkinnyConfig(16, 512, num_warps=8),
           SkinnyConfig(8, 256, dot=False), SkinnyConfig(16, 256, dot=False), SkinnyConfig(4, 512, dot=False)]
EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def graphed_us(fn, reps: int = 20) -> float:
    """Microseconds one call of `fn` takes replayed from a CUDA graph (median of 5 timings of `reps`);
    off CUDA (a smoke run under TRITON_INTERPRET=1) one eager call's."""
    fn()
    if DEVICE != "cuda":
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e6
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[2]


def copy_ceiling_gbs() -> float:
    src = torch.empty(1 << (28 if DEVICE == "cuda" else 20), dtype=torch.float32, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / graphed_us(lambda: dst.copy_(src), reps=5) / 1e3


class Layer:
    """One layer's weights, bf16, as the engine holds them (q/k/v and gate/up stacked)."""

    def __init__(self, c: dict) -> None:
        h, d = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
        qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
        new = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16) / shape[-1] ** 0.5  # noqa: E731
        self.qkv, self.qkv_bias, self.o = new(qkv, h), new(qkv), new(h, c["num_attention_heads"] * d)
        self.gate_up, self.down = new(2 * c["intermediate_size"], h), new(h, c["intermediate_size"])
        self.norm1 = torch.rand(h, device=DEVICE, dtype=torch.bfloat16) + 0.5
        self.norm2 = torch.rand(h, device=DEVICE, dtype=torch.bfloat16) + 0.5


def ops(layer: Layer, h: torch.Tensor, res: torch.Tensor, attn: torch.Tensor) -> dict:
    """name -> (fused call taking a config, unfused call, bytes of weight it streams)."""
    w = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    act = torch.empty(h.shape[0], layer.down.shape[1], device=DEVICE, dtype=torch.bfloat16).normal_()
    return {
        "qkv (+norm, bias)": (lambda c: skinny_linear(h, layer.qkv, layer.qkv_bias, norm_weight=layer.norm1, eps=EPS, config=c),
                              lambda: F.linear(add_rms_norm(h, res, layer.norm1, EPS)[0], layer.qkv, layer.qkv_bias),
                              w(layer.qkv, layer.qkv_bias)),
        "o (+residual)": (lambda c: skinny_linear(attn, layer.o, residual=h, config=c),
                          lambda: F.linear(attn, layer.o), w(layer.o)),
        "gate_up (+norm, SiLU-mul)": (lambda c: skinny_linear(h, layer.gate_up, norm_weight=layer.norm2, eps=EPS,
                                                              silu_mul=True, config=c),
                                      lambda: silu_mul(F.linear(add_rms_norm(h, res, layer.norm2, EPS)[0], layer.gate_up)),
                                      w(layer.gate_up)),
        "down (+residual)": (lambda c: skinny_linear(act, layer.down, residual=h, config=c),
                             lambda: F.linear(act, layer.down), w(layer.down)),
    }


def check(fused, unfused, residual: torch.Tensor | None) -> float:
    """Largest difference over the largest magnitude, fused vs unfused (plus the add the unfused op
    leaves to the next norm)."""
    got, ref = fused(SkinnyConfig()).float(), unfused().float()
    if residual is not None:
        ref += residual.float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu/bench_skinny.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder (config.json is enough)")
    p.add_argument("--out", required=True, help="the report's .md path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    c = json.load(open(os.path.join(a.model, "config.json")))
    layers = [Layer(c) for _ in range(c["num_hidden_layers"])]
    h_dim, q_dim = c["hidden_size"], c["num_attention_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    ceiling = copy_ceiling_gbs()
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    lines = [f"# Skinny fused matmuls vs cuBLAS: {os.path.basename(a.model)}, {device_name}", "",
             f"torch {torch.__version__}; copy ceiling {ceiling:.0f} GB/s; {len(layers)} layers, one weight copy each; "
             "us = one launch, graphed (median of 5 x 20 replays of a graph of one launch per layer).", "",
             "## Each op alone, 1 row", "", "| op | unfused us (launches) | rel. error | "
             + " | ".join(str(cfg) for cfg in CONFIGS) + " | best | % of ceiling (best) |",
             "|---" * (len(CONFIGS) + 5) + "|"]
    best: dict[str, SkinnyConfig] = {}
    rows = 1
    h = torch.randn(rows, h_dim, device=DEVICE, dtype=torch.bfloat16)
    res, attn = torch.randn_like(h), torch.randn(rows, q_dim, device=DEVICE, dtype=torch.bfloat16)
    per_layer = [ops(layer, h, res, attn) for layer in layers]
    for name in per_layer[0]:
        fused0, unfused0, nbytes = per_layer[0][name]
        error = check(fused0, unfused0, h if "residual" in name else None)
        unfused_us = graphed_us(lambda: [o[name][1]() for o in per_layer]) / len(layers)
        cells, timed = [], {}
        for cfg in CONFIGS:
            try:
                timed[cfg] = graphed_us(lambda: [o[name][0](cfg) for o in per_layer]) / len(layers)
                cells.append(f"{timed[cfg]:.1f}")
            except Exception as e:  # a tile the compiler refuses (shared memory, register limits)
                cells.append(f"({type(e).__name__})")
        best[name] = min(timed, key=timed.get)
        launches = 1 + ("norm" in name) + ("SiLU" in name)
        lines.append(f"| {name} | {unfused_us:.1f} ({launches}) | {error:.1e} | " + " | ".join(cells)
                     + f" | {best[name]} | {nbytes / timed[best[name]] / 1e3 / ceiling:.0%} |")
        print(lines[-1], flush=True)
    lines += ["", "## The chain, all layers (qkv, o, gate_up, down; the unfused adds two norms and SiLU-mul)", "",
              "| rows | unfused us | fused us (best configs) | saved us | weight bytes at the ceiling us |",
              "|---|---|---|---|---|"]
    for rows in (1, 5):
        h = torch.randn(rows, h_dim, device=DEVICE, dtype=torch.bfloat16)
        res, attn = torch.randn_like(h), torch.randn(rows, q_dim, device=DEVICE, dtype=torch.bfloat16)
        per_layer = [ops(layer, h, res, attn) for layer in layers]
        unfused = graphed_us(lambda: [f() for o in per_layer for (_, f, _) in o.values()], reps=10)
        fused = graphed_us(lambda: [f(best[n]) for o in per_layer for n, (f, _, _) in o.items()], reps=10)
        total = sum(nb for o in per_layer for (_, _, nb) in o.values())
        lines.append(f"| {rows} | {unfused:.0f} | {fused:.0f} | {unfused - fused:.0f} | {total / ceiling / 1e3:.0f} |")
        print(lines[-1], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
