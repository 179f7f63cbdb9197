"""A decoder layer's step eager and compiled (EngineConfig.compile_model) on CPU. (Not a test.)

    PYTHONPATH=. python benchmarks/micro/bench_compiled_step.py          # draft fp32 / bf16 / int4, target fp32
    PYTHONPATH=. python benchmarks/micro/bench_compiled_step.py --cases 0.5b:int4 --rows 1,5 --rounds 9
    PYTHONPATH=. python benchmarks/micro/bench_compiled_step.py --layers 24 --inductor-cache /tmp/fresh  # twice:
        # the first run's compile seconds are a first start-up's, the second's a later one's

Each case builds --layers decoder layers of a default-pair model (qwen2.5-coder 0.5b / 1.5b) at its
real shapes and weight format, with random weights (nothing read from disk), and prefills
--context tokens. The same runner's layers then run eagerly and through runtime/compiled_model.py
in turn, --rounds times (alternating, so a neighbour's load on a shared machine hits both alike;
each turn is the mean of --reps forwards after one untimed), and medians count. Per case and row
count (1: a decode step, 5: a K = 4 verification): ms per layer eager and compiled, the median of
the rounds' compiled / eager ratios, compile seconds (both graphs, at start-up), ops per layer
(eager: aten ops a TorchDispatchMode sees, views apart; compiled: kernels the graph launches, from
the profiler, and the aten ops of the eager attention inside its op) and the compiled hidden states'
largest error relative to eager's largest value. Writes results/DATE-compiled-step[-TAG].md.
"""
import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path.insert(0, HERE)
MODELS = {"0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m", "1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m"}
BLOCK = 16


def build(name: str, fmt: str, layers: int, context: int, rows: list[int]):
    """A runner of `layers` layers of model `name` in format `fmt`, compiled (its eager model kept),
    with `context` tokens prefilled."""
    import torch

    from ssd_engine.core.config_parts import CacheConfig, ModelConfig
    from ssd_engine.distributed.comm import TPGroup
    from ssd_engine.models.default_models import cache_dir
    from ssd_engine.models.loader import load_config
    from ssd_engine.runtime.model_runner import ModelRunner, RunnerSpec
    from ssd_engine.runtime.step_inputs import StepInputs

    class RandomRunner(ModelRunner):
        """Weights of a model's scale (dummy ones are uniform within 1e-3): errors then mean something."""
        def _pack(self, module_name, module):
            generator = torch.Generator().manual_seed(len(module_name))
            for pname, param in module.named_parameters(recurse=False):
                if "embed" in module_name or "lm_head" in module_name:
                    continue  # the timed layers never read them
                noise = torch.randn(param.shape, generator=generator)
                param.data.copy_(1 + 0.1 * noise if "norm" in module_name else 0.02 * noise)
            super()._pack(module_name, module)

    path = os.path.join(cache_dir(), MODELS[name])
    hf = load_config(path)
    hf.num_hidden_layers = layers
    blocks = -(-(context + max(rows)) // BLOCK)
    model = ModelConfig(path, None, "float32" if fmt == "fp32" else "bfloat16", "cpu", "packed",
                        weight_format=None if fmt == "fp32" else fmt, load_format="dummy", compile=True)
    runner = RandomRunner(RunnerSpec(model, CacheConfig(BLOCK, blocks + 1), context + max(rows) + 1), TPGroup.single(), hf)
    runner.run(StepInputs([0], [[(3 + i) % 1000 for i in range(context)]], [list(range(blocks))], [[context - 1]]))
    steps = {n: runner.prepare(StepInputs([context], [[42 + i for i in range(n)]], [list(range(blocks))], [[0]]))
             for n in rows}
    return runner, steps




def eager_ops(model, ids, positions, meta) -> tuple[float, float]:
    """(aten ops, of which views) per layer, as a TorchDispatchMode sees them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = self.views = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.views += bool(func.is_view)
            return func(*args, **(kwargs or {}))

    x = model.embed_tokens(ids)
    counter = Count()
    with counter:
        for layer in model.layers:
            x = layer(positions, x, meta)
    return counter.ops / len(model.layers), counter.views / len(model.layers)


def compiled_kernels(model, ids, positions, meta) -> tuple[float, float, float]:
    """(fused kernels, extern calls, aten ops of the eager attention) per layer of a compiled step,
    from the profiler; the fused kernels include the embedding's and the final norm's share."""
    import torch._inductor.config as inductor_config
    from torch.profiler import profile

    from ssd_engine.runtime.compiled_model import CompiledModel

    with inductor_config.patch({"cpp.enable_kernel_profile": True}):  # records each C++ kernel
        counted = CompiledModel(model)
        counted(ids, positions, meta)
    with profile() as prof:
        counted(ids, positions, meta)
    events = prof.events()
    in_graph = [e for e in events if e.cpu_parent is not None and e.cpu_parent.name.startswith("## Call CompiledFxGraph")]
    fused = sum("cpp_fused" in e.name for e in in_graph)
    extern = len(in_graph) - fused
    attention = sum(1 for e in events if e.cpu_parent is not None and e.cpu_parent.name == "ssd_engine::paged_attention")
    layers = len(model.layers)
    return fused / layers, extern / layers, attention / layers


def time_pair(runner, step, rounds: int, reps: int) -> tuple[list[float], list[float]]:
    """Seconds per forward of the layers, eager and compiled, alternating."""
    model = runner.model.model
    ids, positions, meta = step
    eager = lambda: model(ids, positions, meta)
    compiled = lambda: runner.compiled(ids, positions, meta)
    times = ([], [])
    for _ in range(rounds):
        for forward, out in zip((eager, compiled), times):
            forward()
            start = time.perf_counter()
            for _ in range(reps):
                forward()
            out.append((time.perf_counter() - start) / reps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="0.5b:fp32,0.5b:bf16,0.5b:int4,1.5b:fp32",
                        help="model:format pairs (model 0.5b or 1.5b; format fp32, bf16, int8 or int4)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rows", default="1", help="tokens per step, comma-separated (1: decode; 5: K=4 verify)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, pinned to as many cores")
    parser.add_argument("--inductor-cache", default=None,
                        help="inductor's cache folder (TORCHINDUCTOR_CACHE_DIR); an empty one: first-run compile times")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    cache_state = "the default inductor cache"
    if args.inductor_cache:
        cache_state = ("an empty" if not os.path.isdir(args.inductor_cache) or not os.listdir(args.inductor_cache)
                       else "a filled") + " inductor cache"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
    import torch
    torch.set_num_threads(args.threads)
    from suite.machine import machine_line

    rows = [int(r) for r in args.rows.split(",")]
    lines = ["| model | format | tokens | eager ms/layer | compiled ms/layer | compiled/eager | compile s "
             "| eager aten ops/layer (views) | compiled kernels/layer: fused + extern (+ attention's aten ops) "
             "| max rel. error |", "|---" * 10 + "|"]
    per_round = []
    for case in args.cases.split(","):
        name, fmt = case.split(":")
        runner, steps = build(name, fmt, args.layers, args.context, rows)
        model = runner.model.model
        with torch.inference_mode():
            for n, step in steps.items():
                reference, compiled = model(*step), runner.compiled(*step)
                error = ((compiled.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
                ops, views = eager_ops(model, *step)
                fused, extern, attention = compiled_kernels(model, *step)
                eager_s, compiled_s = time_pair(runner, step, args.rounds, args.reps)
                per_layer = lambda s: statistics.median(s) / args.layers * 1e3
                ratio = statistics.median(c / e for c, e in zip(compiled_s, eager_s))
                lines.append(f"| {name} | {fmt} | {n} | {per_layer(eager_s):.3f} | {per_layer(compiled_s):.3f} "
                             f"| {ratio:.3f} | {runner.compiled.compile_seconds:.1f} | {ops:.0f} ({views:.0f}) "
                             f"| {fused:.1f} + {extern:.0f} (+ {attention:.0f}) | {error:.1e} |")
                per_round.append(f"{name} {fmt} {n} tokens, eager / compiled ms per layer by round: " + "; ".join(
                    f"{e / args.layers * 1e3:.2f} / {c / args.layers * 1e3:.2f}" for e, c in zip(eager_s, compiled_s)))
                print(lines[-1], flush=True)
        del runner, steps, model
    date = datetime.date.today().isoformat()
    text = "\n".join([
        f"# Compiled decoder steps on CPU, {date}", "",
        f"`python benchmarks/micro/bench_compiled_step.py {' '.join(sys.argv[1:])}`", "",
        f"{machine_line()}; {args.threads} thread(s) pinned; {args.layers} layers at the model's real shapes, "
        f"random weights, {args.context}-token context; {cache_state}; "
        f"medians over {args.rounds} alternating rounds of {args.reps} forwards.", "",
        *lines, "", *[f"- {line}" for line in per_round], ""])
    print(text)
    path = os.path.join(HERE, "results", f"{date}-compiled-step{'-' + args.tag if args.tag else ''}.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
