"""What each CPU weight layout costs in speed and memory on one core. (Not a test.)

    PYTHONPATH=. python benchmarks/micro/bench_layouts.py    # default target: plain / packed / dual
    PYTHONPATH=. python benchmarks/micro/bench_layouts.py --which draft --rounds 5

(PYTHONPATH=. so this checkout's ssd_engine is timed, not an installed one.)

`plain` keeps F.linear's row-major weights, `packed` oneDNN's blocked copy only, `dual` both
(plain for one row, packed for more). One process pinned to one core with one thread loads the
model in `dual`, which holds both copies, and switches every Linear between them, so all layouts
are timed on the same weights in the same process, in turn, `--rounds` times (the order rotates
each round): on a shared machine whose speed drifts by tens of percent between minutes, only such
paired figures compare. Per layout: AR decode tok/s of a greedy generation, the forward's
seconds for 1, 2 and K+1 new tokens (one decode step, a small batch, one verification), and the
bytes of weights it holds. Writes results/DATE-layouts[-TAG].md.
"""
import argparse
import datetime
import os
import statistics
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path.insert(0, HERE)
from suite.machine import machine_line  # noqa: E402

LAYOUTS = ("plain", "packed", "dual")
GB = 2**30


class LayoutSwitch:
    """Holds both copies of every Linear (the model was loaded "dual") and shows it one layout."""

    def __init__(self, model) -> None:
        from ssd_engine.layers.linear import Linear
        self.linears = [(m, m.weight, m.prepared) for m in model.modules() if isinstance(m, Linear)]
        self.other = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                         if not name.endswith(".weight") or "norm" in name or "embed" in name)

    def use(self, layout: str) -> None:
        for module, weight, packed in self.linears:
            module.weight = weight if layout in ("plain", "dual") or packed is None else None
            module.prepared = packed if layout in ("packed", "dual") else None

    def weight_bytes(self, layout: str) -> int:
        """Weights a model loaded in `layout` holds (embedding, norms and biases included)."""
        total = self.other
        for _, weight, packed in self.linears:
            if layout in ("plain", "dual") or packed is None:
                total += weight.numel() * weight.element_size()
            if layout in ("packed", "dual") and packed is not None:
                total += packed.nbytes
        return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--which", choices=["target", "draft"], default="target", help="default model to use")
    parser.add_argument("--model", default=None, help="HF folder (overrides --which)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="forwards per size per round (their median counts)")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per round for decode tok/s")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    from suite.measure import own_peak_gb
    from suite.probe import ForwardProbe

    from ssd_engine import LLM, SamplingParams
    from ssd_engine.models.default_models import resolve_default_model

    model = args.model or resolve_default_model(args.which)
    llm = LLM(model, speculative_mode="ar", num_threads=1, max_num_seqs=1, cpu_weight_layout="dual",
              enable_prefix_caching=False)
    engine = llm.engine
    switch = LayoutSwitch(engine.runner.model)
    sizes = [1, 2, args.k + 1]
    probe = ForwardProbe(engine.runner, engine.block_manager, 128)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    costs = {layout: {n: [] for n in sizes} for layout in LAYOUTS}
    decode = {layout: [] for layout in LAYOUTS}
    for round_ in range(args.rounds):
        order = LAYOUTS[round_ % 3:] + LAYOUTS[:round_ % 3]
        for layout in order:
            switch.use(layout)
            probe(1)  # warm-up after the switch
            for n in sizes:
                costs[layout][n].append(statistics.median(probe(n) for _ in range(args.reps)))
            [out] = llm.generate(["def quicksort(arr):"], params, use_tqdm=False)
            decode[layout].append(out.metrics.decode_tokens_per_s)
            print(f"round {round_ + 1} {layout}: decode {decode[layout][-1]:.2f} tok/s, forwards (ms) "
                  + ", ".join(f"{n}: {costs[layout][n][-1] * 1e3:.0f}" for n in sizes), flush=True)
    switch.use("dual")
    peak = own_peak_gb()
    probe.close()
    llm.close()

    head = " | ".join(f"{n}-token forward (ms)" for n in sizes)
    lines = [f"| layout | AR decode tok/s | {head} | weights held (GB) |", "|---" * (3 + len(sizes)) + "|"]
    for layout in LAYOUTS:
        cells = " | ".join(f"{statistics.median(costs[layout][n]) * 1e3:.0f}" for n in sizes)
        lines.append(f"| {layout} | {statistics.median(decode[layout]):.2f} | {cells} "
                     f"| {switch.weight_bytes(layout) / GB:.2f} |")
    date = datetime.date.today().isoformat()
    text = "\n".join([
        f"# CPU weight layouts, {date}", "",
        f"`python benchmarks/micro/bench_layouts.py {' '.join(sys.argv[1:])}`", "",
        f"{machine_line()}; model {os.path.basename(model.rstrip('/'))}; core {args.core}, 1 thread; one "
        f"process, layouts switched on the same weights; medians over {args.rounds} rounds (order rotating); "
        f"forwards: median of {args.reps} per round after a 128-token prefix; decode: {args.tokens} greedy "
        f"tokens per round; GB = 2^30 bytes; peak RSS of the process holding both copies: {peak:.2f} GB. "
        f"Weights held include the whole embedding table, of which the engine keeps only looked-up rows "
        f"resident (it is mapped from the checkpoint).", "",
        *lines, "",
        "Every round's decode tok/s: " + "; ".join(
            f"{layout} " + ", ".join(f"{v:.2f}" for v in decode[layout]) for layout in LAYOUTS) + ".", ""])
    print(text)
    path = os.path.join(HERE, "results", f"{date}-layouts{'-' + args.tag if args.tag else ''}.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
