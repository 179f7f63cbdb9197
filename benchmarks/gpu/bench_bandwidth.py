"""How close does one decode step come to the memory bandwidth of the device? (Not a test.)

    taskset -c 1 python benchmarks/gpu/bench_bandwidth.py                 # default pair, CPU, fp32
    python benchmarks/gpu/bench_bandwidth.py --device cuda --batch 1,4,16  # bf16 on the GPU

A decode step is memory-bound: it streams the weights and each sequence's KV cache once. Its
achieved bandwidth is the bytes it must read at least divided by its measured time. The byte model:
- weights: every Linear's matrix (+ bias) once, one copy only (the CPU "dual" layout keeps a plain and
  a packed copy, and a step reads one of them), every norm's weight, and the LM head's whole matrix
  (a tied head is the embedding table: counted once, here); the embedding reads only the `batch`
  looked-up rows. Bytes come from the engine's own parameters, so dtype and layout are honoured.
- KV cache: per sequence 2 * layers * kv_heads * head_dim * (context + 1) * dtype bytes (the step at
  position `context` attends to the prefix and to its own token).
- not counted (each well under 1% here): activations, RoPE table rows, logits, the block tables.
The step is timed on the engine's ModelRunner.run(StepInputs) with hand-made block tables: after a
prefill of `context` tokens the same one-token step is repeated (same position, so every repetition
does the same work); the median of `--steps` after `--warmup`. The ceiling is measured with torch on
the same threads: read (sum of a 1 GiB fp32 tensor) and copy ((read + written bytes) / time), best of 5;
on CUDA also the datasheet peak of known GPUs. Writes results/DATE-bandwidth-DEVICE.md (or `--out`).
"""

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path.insert(0, HERE)
from suite.machine import device_name, machine_line  # noqa: E402

# datasheet HBM peaks in GB/s: (substrings the device name must all contain, peak); first match wins
PEAKS_GBS = [
    (("H200",), 4800),
    (("H100", "PCIe"), 2000),
    (("H100", "HBM3"), 3350),
    (("H100", "SXM"), 3350),
    (("A100", "SXM", "80GB"), 2039),
]
BLOCK_SIZE = 16  # EngineConfig's default block size


def peak_bytes_per_s(name: str) -> float | None:
    return next((gbs * 1e9 for parts, gbs in PEAKS_GBS if all(p in name for p in parts)), None)


def step_bytes(runner, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of `batch` sequences at position `context` reads."""
    from ssd_engine.layers.embedding import VocabParallelEmbedding
    from ssd_engine.layers.linear import Linear

    weights = 0
    for module in runner.model.modules():
        if isinstance(module, Linear):  # one copy: the plain matrix if kept, else the packed one
            plain = module.weight
            weights += (
                plain.numel() * plain.element_size()
                if plain is not None
                else module.prepared.nbytes
            )
            weights += (
                module.bias.numel() * module.bias.element_size() if module.bias is not None else 0
            )
        elif isinstance(module, VocabParallelEmbedding):  # only the looked-up rows
            weights += batch * module.weight.shape[1] * module.weight.element_size()
        else:  # norms and anything else with parameters of its own: read whole
            weights += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    per_token = runner.kv_bytes_per_block(runner.config, 1, runner.dtype)
    return weights, batch * (context + 1) * per_token


def measure_ceiling(device: torch.device, gib: float = 1.0, reps: int = 5) -> dict[str, float]:
    """STREAM-like bytes/s with torch: read (sum) and copy (read + write), best of `reps`."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    src = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4

    def best(fn) -> float:
        fn()  # warm-up: first touch of the pages / kernel launch
        times = []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    result = {"read": nbytes / best(src.sum), "copy": 2 * nbytes / best(lambda: dst.copy_(src))}  # noqa: F821 (deleted after)
    del src, dst
    return result


def time_decode(model_path: str, args, device: torch.device) -> list[dict]:
    """Rows of the table for one model: one per batch size."""
    from ssd_engine.core.config import EngineConfig
    from ssd_engine.core.config_sections import CacheConfig
    from ssd_engine.runtime.model_runner import RunnerSpec
    from ssd_engine.runtime.step_inputs import StepInputs

    config = EngineConfig.from_kwargs(
        model=model_path,
        speculative_mode="ar",
        device=args.device,
        num_threads=args.threads,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        compile_model="on" if args.compile else "off",
        fused_kernels=args.fused_kernels,
    )
    layout = config.model.weight_layout
    blocks = -(-(args.context + 1) // BLOCK_SIZE)
    max_batch = max(args.batch)
    # the engine's own choices (layout, attention backend, CUDA graphs, compile, fused kernels), this dtype
    model = replace(config.model, dtype=args.dtype, device=str(device))
    runner = RunnerSpec(
        model, CacheConfig(BLOCK_SIZE, max_batch * blocks), args.context + 2
    ).build()
    runner.capture_graphs([("paged", 1)])  # as the engine does at start-up (GPU only)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(max_batch)]
    prompt = [3 + i % 250 for i in range(args.context)]  # ids every vocabulary has
    runner.run(StepInputs([0], [prompt], tables[:1], [[args.context - 1]]))
    # identical prompts have identical K/V: copy sequence 0's into every other sequence's own blocks
    # instead of prefilling each (each sequence still reads its own blocks in the step)
    for i in range(1, max_batch):
        first = i * blocks * BLOCK_SIZE
        runner.kv_cache[:, :, first : first + args.context] = runner.kv_cache[:, :, : args.context]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for batch in args.batch:
        step = StepInputs([args.context] * batch, [[42]] * batch, tables[:batch], [[0]] * batch)
        times = []
        for i in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            runner.run(step)
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        weights, kv = step_bytes(runner, batch, args.context)
        kernels, profile = gpu_kernels(runner, step, device)
        rows.append(
            dict(
                batch=batch,
                weights=weights,
                kv=kv,
                seconds=statistics.median(times),
                layout=layout,
                kernels=kernels,
                profile=profile,
                graphs="on" if runner.graphs is not None else "off",
                compiled="on" if runner.compiled is not None else "off",
                fused="on" if runner.layer_ops is not None else "off",
            )
        )
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


TOP_KERNELS = 12  # kernels listed in a batch-1 step's profile


def gpu_kernels(runner, step, device: torch.device) -> tuple[str, list[str]]:
    """Kernels one step runs on the GPU, as the profiler (CUPTI) records them ('n/a' on a CPU): the
    goal is about 10 per decoder layer. Also the step's profile: the kernels taking the most GPU time,
    as table rows (name, launches, us, share of the kernels' summed time)."""
    if device.type != "cuda":
        return "n/a", []
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.run(step)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # a profiler that cannot trace here must not cost the bandwidth figures
    except Exception as error:
        return f"failed: {type(error).__name__}", []
    return (
        f"{len(kernels)} ({len(kernels) / runner.config.num_hidden_layers:.1f} per layer)",
        kernel_profile(kernels),
    )


def kernel_profile(events) -> list[str]:
    """Table rows of the profiler events grouped by name, the most time first (TOP_KERNELS of them),
    then their sum."""
    by_name: dict[str, list] = {}
    for event in events:
        entry = by_name.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us()
    busy = sum(us for _, us in by_name.values()) or 1.0
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    rows = [
        f"| `{name[:80]}` | {calls} | {us:.0f} | {100 * us / busy:.0f}% |"
        for name, (calls, us) in top
    ]
    return rows + [f"| all {len(events)} | {len(events)} | {busy:.0f} | 100% |"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu/bench_bandwidth.py", description=__doc__.splitlines()[0]
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    p.add_argument(
        "--model",
        default=None,
        help="HF folder to measure (default: the built-in target and draft)",
    )
    p.add_argument("--draft", default=None, help="a second HF folder, measured after --model")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=512, help="tokens in each sequence's KV cache")
    p.add_argument(
        "--steps", type=int, default=20, help="timed decode steps per batch size (median)"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: cores this process may use)",
    )
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument(
        "--ceiling-gib", type=float, default=1.0, help="size of the ceiling's fp32 buffers"
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (GPU), plain weights (CPU)"
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights from config.json alone (e.g. configs/shapes/*)",
    )
    p.add_argument(
        "--compile", action="store_true", help="the forward compiled (compile_model='on')"
    )
    p.add_argument(
        "--fused-kernels",
        default="auto",
        choices=("auto", "on", "off"),
        help="a layer's elementwise ops as Triton kernels (auto: on CUDA unless compiled)",
    )
    p.add_argument(
        "--out", default=None, help="Markdown file (default: results/DATE-bandwidth-DEVICE.md)"
    )
    args = p.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",") if b.strip()]
    if not args.batch or min(args.batch) < 1 or args.context < 1 or args.steps < 1:
        p.error("--batch, --context and --steps must be >= 1")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device must be cpu or cuda, got {args.device!r}")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.threads = args.threads or len(os.sched_getaffinity(0))
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.out = args.out or os.path.join(
        HERE, "results", f"{datetime.date.today()}-bandwidth-{kind}.md"
    )
    return args


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    torch.set_num_threads(args.threads)  # the engine's threads = the ceiling's threads
    device = torch.device(args.device)
    if args.model:
        models = [("model", args.model)] + ([("draft", args.draft)] if args.draft else [])
    else:
        from ssd_engine.models.default_models import resolve_default_model

        models = [
            ("target", resolve_default_model("target")),
            ("draft", resolve_default_model("draft")),
        ]
    ceiling = measure_ceiling(
        device, args.ceiling_gib
    )  # before any model: the 1 GiB buffers need the memory
    best = max(ceiling.values())
    peak = peak_bytes_per_s(device_name(args.device)) if device.type == "cuda" else None
    pct = lambda part, whole: f"{100 * part / whole:.0f}%" if whole else "n/a"
    lines = [
        "| model | dtype | batch | context | bytes per step (MB) | of which KV (MB) | step ms | achieved GB/s "
        "| ceiling GB/s | % of ceiling | % of peak | GPU kernels per step |",
        "|" + "---|" * 12,
    ]
    layouts, profiles = [], []
    for role, path in models:
        rows = time_decode(path, args, device)
        layouts.append(
            f"{role} {rows[0]['layout']}, CUDA graphs {rows[0]['graphs']}, compiled forward {rows[0]['compiled']}, "
            f"fused layer kernels {rows[0]['fused']}"
        )
        for r in rows:
            total = r["weights"] + r["kv"]
            achieved = total / r["seconds"]
            lines.append(
                f"| {role} ({os.path.basename(path.rstrip('/'))}) | {args.dtype} | {r['batch']} "
                f"| {args.context} | {total / 1e6:.1f} | {r['kv'] / 1e6:.1f} | {r['seconds'] * 1e3:.2f} "
                f"| {achieved / 1e9:.1f} | {best / 1e9:.1f} | {pct(achieved, best)} | {pct(achieved, peak)} | {r['kernels']} |"
            )
            # where the smallest batch's step time goes
            if r["profile"] and r["batch"] == min(args.batch):
                profiles += [
                    f"{role}, batch {r['batch']}: one step's GPU kernels by time (CUPTI; the step took "
                    f"{r['seconds'] * 1e6:.0f} us on the wall)",
                    "",
                    "| kernel | launches | us | share |",
                    "|---|---|---|---|",
                    *r["profile"],
                    "",
                ]
    table = "\n".join(lines)
    cores = sorted(os.sched_getaffinity(0))
    # the affinity was set outside (taskset): put it into the command that reproduces the run
    pin = (
        ["taskset", "-c", ",".join(map(str, cores))]
        if device.type == "cpu" and len(cores) < os.cpu_count()
        else []
    )
    placement = (
        f"GPU {device}"
        if device.type == "cuda"
        else f"{args.threads} torch thread(s), process affinity cores {cores} of {os.cpu_count()}"
    )
    report = "\n".join(
        [
            f"# Decode-step memory bandwidth ({datetime.date.today()}, {args.device})",
            "",
            "`" + " ".join([*pin, "python benchmarks/gpu/bench_bandwidth.py", *argv]) + "`",
            "",
            f"{machine_line(args.device)}; {placement}; weight layout: {'; '.join(layouts)}; "
            f"median of {args.steps} steps after {args.warmup} warm-up; MB = 1e6 bytes, GB/s = 1e9 bytes/s.",
            "",
            f"Measured ceiling (torch, same threads, best of 5 on {args.ceiling_gib:g} GiB fp32): read (sum) {ceiling['read'] / 1e9:.1f} GB/s, "
            f"copy (read + write) {ceiling['copy'] / 1e9:.1f} GB/s; the ceiling column is the larger. "
            f"Datasheet peak: {f'{peak / 1e12:.2f} TB/s' if peak else 'unknown for this device'}.",
            "",
            "Bytes per step: every weight matrix once (one copy even with the dual CPU layout), norms, the whole LM "
            "head, the looked-up embedding rows, plus per sequence 2 x layers x kv_heads x head_dim x (context + 1) "
            "x dtype bytes of KV (see the script's docstring).",
            "",
            table,
            "",
            *profiles,
        ]
    )
    print(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    return report


if __name__ == "__main__":
    main()
