"""Device-independent proxies of GPU costs, counted on CPU (issue 22): run it after any change to a
forward, the sampler or the round's bookkeeping.

    python benchmarks/profiling/bench_ops.py                        # default pair, every draft format
    python benchmarks/profiling/bench_ops.py --formats int4 --modes sd --steps 2

1. Ops per decoder layer in a one-token decode step (tests/instrumentation/op_count.py): every aten
   op the dispatcher routes inside one layer's forward, by name and call site, for the target and
   the draft in each weight format, at the real shapes (the pair's configs, two layers, synthetic
   weights, as planning/forward_timing.py builds them); plus the rest of the step (inputs, LM head) and
   the sampling after it. On a GPU each compute op is a kernel launch. Goal: <= 10 per layer.
   The GPU path (Triton attention and the fused layer kernels, kernels/fused_layer_ops.py) is
   counted too, under Triton's interpreter: each Triton launch one kernel, split-KV attention as an
   H100 runs a batch-1 decode (`--gpu-path`, on by default).
2. Host launches of a prefill chunk on the GPU path, eager and with piecewise graphs
   (runtime/piecewise_graphs.py), at the real shapes.
3. Ops and device-to-host syncs per engine step (tests/instrumentation/step_count.py): an AR step,
   an SD round, an SSD round (the coordinator's side), greedy and sampled, on a tiny pair (syncs
   do not depend on the model's size). Goal: 1 sync per round (the accepted tokens).

Row padding (CPU only, measured per machine) is off while counting: the counts are the same on
every machine. Writes benchmarks/results/DATE-ops.md and .json (with the CPU model).
"""

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO = os.path.dirname(HERE)
sys.path[:0] = [
    REPO,
    os.path.join(REPO, "tests"),
    HERE,
]  # tests/: the tiny pair, the counters; benchmarks/: suite

FORMATS = ("fp32", "bf16", "int8", "int4")
MODES = ("ar", "sd", "ssd")
TEMPERATURES = (0.0, 0.7)
PREFIX = 32  # tokens in the KV cache before the counted decode step
BLOCK = 16
GOAL_OPS_PER_LAYER, GOAL_SYNCS_PER_ROUND = 10, 1
H100_SMS = 132  # the GPU path's split-KV, as paged_attention._num_splits picks it on an H100
os.environ.setdefault(
    "TRITON_INTERPRET", "1"
)  # the GPU path's kernels, on CPU (read when they are imported)


# ---- 1. ops per decoder layer at real shapes ----------------------------------------------------
def _runner(path: str, fmt: str | None, gpu_path: bool = False, layers: int = 2, graphs: int = 0):
    """`path`'s model with two decoder layers (the first does the step's once-per-step attention
    work, the second is a plain layer) and dummy weights (load_format="dummy"), in format `fmt` (None: the target's
    packed fp32); `gpu_path`: with a GPU's attention backend and layer kernels, interpreted; `graphs`:
    CUDA graphs' row cap (emulated on CPU; 0: none)."""
    import torch

    from ssd_engine.core.config_parts import CacheConfig, ModelConfig
    from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE
    from ssd_engine.models.loader import load_config
    from ssd_engine.runtime.cuda_graphs import emulated
    from ssd_engine.runtime.model_runner import RunnerSpec

    hf_config = load_config(path)
    real_layers = hf_config.num_hidden_layers
    hf_config.num_hidden_layers = layers
    dtype = "float32" if fmt is None or ACTIVATION_DTYPE[fmt] == torch.float32 else "bfloat16"
    model = ModelConfig(
        path,
        None,
        dtype,
        "cpu",
        "packed",
        weight_format=fmt,
        load_format="dummy",
        attention_backend="triton" if gpu_path else "torch",
        fused_kernels="on" if gpu_path else "off",
        cuda_graph_max_batch=graphs,
    )
    blocks = -(-(PREFIX + 2) // BLOCK)
    with emulated(bool(graphs)):
        runner = RunnerSpec(model, CacheConfig(BLOCK, blocks), PREFIX + 2).build(
            hf_config=hf_config
        )
    return runner, real_layers, blocks


def layer_counts(path: str, fmt: str | None, gpu_path: bool = False) -> dict:
    """One decode step's ops by scope: each of two layers, the rest of the forward, and sampling."""
    import torch
    from instrumentation.op_count import OpCounter

    from ssd_engine import SamplingParams
    from ssd_engine.core.structures import Sequence
    from ssd_engine.runtime.step_inputs import StepInputs
    from ssd_engine.sampling.verifier import Verifier

    runner, num_layers, blocks = _runner(path, fmt, gpu_path)
    vocab = runner.config.vocab_size
    table = list(range(blocks))
    runner.run(StepInputs([0], [[(3 + i) % vocab for i in range(PREFIX)]], [table], [[PREFIX - 1]]))
    verifier = Verifier(torch.Generator().manual_seed(0))
    greedy, sampled = (
        [Sequence([3, 4], SamplingParams(temperature=t, seed=0), BLOCK)] for t in (0.0, 0.7)
    )
    ops = OpCounter()
    layers = list(runner.model.model.layers)
    with ops.scoped(layers, ["layer 0", "layer 1"]), ops, _h100_splits():
        logits = runner.run(StepInputs([PREFIX], [[42 % vocab]], [table], [[0]]))
        with ops.scope("sampling, greedy"):
            verifier.sample(greedy, logits)
        with ops.scope("sampling, T = 0.7"):
            verifier.sample(sampled, logits)
    first, plain = ops.total("layer 0"), ops.total("layer 1")
    outside = ops.total("step")
    sites = _sites(ops, "layer 1")
    return {
        "layers": num_layers,
        "per_layer": plain,
        "per_layer_compute": ops.total("layer 1", "compute"),
        "torch_attention": sum(s["calls"] for s in sites if s["site"].endswith(" torch_attention")),
        "first_layer_extra": first - plain,
        "outside_layers": outside,
        "sampling_greedy": ops.total("sampling, greedy"),
        "sampling_t07": ops.total("sampling, T = 0.7"),
        "step_total": num_layers * plain + first - plain + outside + ops.total("sampling, greedy"),
        "by_op": {f"{op} ({kind})": n for (op, kind), n in sorted(ops.by("op", "layer 1").items())},
        "by_site": sites,
    }


@contextlib.contextmanager
def _h100_splits():
    """Split-KV attention as on an H100 (on CPU the kernel runs one split): its merge is a launch."""
    from ssd_engine.kernels import paged_attention

    if paged_attention.triton is None:
        yield
        return
    saved = paged_attention._num_splits
    paged_attention._num_splits = lambda programs, device: max(
        1, min(paged_attention.MAX_SPLITS, -(-2 * H100_SMS // programs))
    )
    try:
        yield
    finally:
        paged_attention._num_splits = saved


def _sites(ops, scope: str) -> list[dict]:
    """[{site, op, kind, calls}] of one scope, in file and line order."""
    merged: dict = {}
    for (s, op, kind, site), n in ops.counts.items():
        if s == scope:
            merged[(site, op, kind)] = merged.get((site, op, kind), 0) + n

    def order(key):
        path, _, rest = key[0].partition(":")
        line = rest.split(" ")[0]
        return path, int(line) if line.isdigit() else 0, key[1]

    return [
        {"site": site, "op": op, "kind": kind, "calls": n}
        for (site, op, kind), n in sorted(merged.items(), key=lambda item: order(item[0]))
    ]


def model_rows(target: str, draft: str, formats: list[str], gpu_path: bool = True) -> list[dict]:
    rows = [{"model": "target", "format": "fp32", **layer_counts(target, None)}]
    rows += [{"model": "draft", "format": fmt, **layer_counts(draft, fmt)} for fmt in formats]
    if gpu_path:  # fp32: the interpreter's bf16 is wrong, and the kernels are the same for bf16
        rows += [
            {"model": model, "format": "fp32, GPU path", **layer_counts(path, None, gpu_path=True)}
            for model, path in (("target", target), ("draft", draft))
        ]
    return rows


# ---- 2. host launches of a prefill chunk --------------------------------------------------------
def prefill_launches(path: str) -> dict:
    """A PREFIX-token prefill on the GPU path, counted eagerly and with piecewise graphs
    (runtime/piecewise_graphs.py, emulated; each piece's replay one launch): the launches the host
    issues (compute ops) and all its ops, per decoder layer (3 layers minus 2) and in total at the
    model's depth."""
    from instrumentation.op_count import OpCounter

    from ssd_engine.runtime.step_inputs import StepInputs

    counts = {}
    for graphs in (0, 4):
        for layers in (2, 3):
            runner, depth, blocks = _runner(path, None, gpu_path=True, layers=layers, graphs=graphs)
            prefill = StepInputs(
                [0], [[3 + i for i in range(PREFIX)]], [list(range(blocks))], [[PREFIX - 1]]
            )
            runner.run(prefill)  # makes the emulated graphs of the bucket
            ops = OpCounter()
            replays = 0
            if graphs:

                def counted(replay):
                    def run():
                        nonlocal replays
                        replays += 1
                        with ops.scope("replay"):
                            replay()

                    return run

                for size, pieces in runner.piecewise.graphs.items():
                    runner.piecewise.graphs[size] = [counted(piece) for piece in pieces]
            with ops:
                runner.run(prefill)
            counts[graphs, layers] = (
                ops.total("step", "compute") + replays,
                ops.total("step") + replays,
            )
    row = {"tokens": PREFIX, "layers": depth}
    for graphs, name in ((0, "eager"), (4, "piecewise")):
        for index, what in enumerate(("launches", "ops")):
            per_layer = counts[graphs, 3][index] - counts[graphs, 2][index]
            row[f"{name}_{what}_per_layer"] = per_layer
            row[f"{name}_{what}"] = counts[graphs, 2][index] + (depth - 2) * per_layer
    return row


# ---- 3. ops and syncs per engine step on a tiny pair --------------------------------------------
def tiny_pair(root: str) -> tuple[str, str]:
    from tiny_checkpoints import build_checkpoint

    return (
        build_checkpoint(os.path.join(root, "target"), "qwen2", seed=0),
        build_checkpoint(os.path.join(root, "draft"), "qwen2", seed=0, num_hidden_layers=1),
    )


def engine_rows(
    target: str, draft: str, modes: list[str], k: int, steps: int, draft_dtype: str
) -> list[dict]:
    """Per mode and temperature: `steps` decode steps under the op counter and `steps` more under
    the sync counter, after the prefill and one round (an SSD sequence's first round is a certain
    cache miss)."""
    from instrumentation.step_count import count_ops, count_syncs, op_summary, sync_summary

    from ssd_engine import LLM, SamplingParams

    rows = []
    for mode in modes:
        options = dict(speculative_mode=mode, num_threads=1, max_model_len=256)
        if mode != "ar":
            options.update(draft_model=draft, num_speculative_tokens=k, draft_dtype=draft_dtype)
        with LLM(target, **options) as llm:
            engine = llm.engine
            for temperature in TEMPERATURES:
                seq = engine.add_request(
                    list(range(3, 20)),
                    SamplingParams(
                        temperature=temperature, seed=0, max_tokens=200, ignore_eos=True
                    ),
                )
                engine.step()
                engine.step()
                ops = [op_summary(count_ops(engine)) for _ in range(steps)]
                syncs = [sync_summary(count_syncs(engine)) for _ in range(steps)]
                engine.abort(seq)
                rows.append(
                    {
                        "mode": mode,
                        "temperature": temperature,
                        "k": k if mode != "ar" else None,
                        "ops_steps": ops,
                        "sync_steps": syncs,
                    }
                )
    return rows


def _median(steps: list[dict], key: str) -> str:
    return f"{statistics.median(step[key] for step in steps):g}"


# ---- the report ----------------------------------------------------------------------------------
def render(raw: dict) -> str:
    cpu = raw["cpu"]
    lines = [
        f"# GPU-cost proxies counted on CPU, {raw['date']}",
        "",
        f"- Machine: {cpu['cpu_model']} ({', '.join(cpu['cpu_flags'])}), {cpu['visible_cores']} cores "
        f"visible; torch {cpu['torch']}; commit {raw['commit']}",
        f"- Command: `{raw['command']}`",
        f"- Target `{raw['target']}`, draft `{raw['draft']}`; row padding off (CPU only, per machine)",
        "",
    ]
    return (
        "\n".join(
            lines
            + layer_lines(raw["layers"])
            + prefill_lines(raw.get("prefill", []))
            + engine_lines(raw["engine"])
        )
        + "\n"
    )


def layer_lines(layers: list[dict]) -> list[str]:
    lines = [
        f"## Ops per decoder layer, one 1-token decode step (goal <= {GOAL_OPS_PER_LAYER})",
        "",
        "An op is one aten op the dispatcher routes (tests/instrumentation/op_count.py); compute ops write "
        "memory (on a GPU at least one kernel launch each), the rest are views. The first layer also "
        "expands the step's attention metadata for the torch backend (once per step). Step total = "
        "layers x per layer + first-layer extra + outside the layers (inputs, final norm, LM head) + "
        "greedy sampling. Attention runs the torch reference backend (CPU's); on a GPU the Triton backend "
        "runs its ops as one kernel (the torch attention column: that backend's ops in a layer). "
        "GPU path rows: Triton attention and the fused layer kernels (kernels/fused_layer_ops.py), run by "
        "Triton's interpreter, each launch counted as one compute op (`triton:` ops), split-KV as an "
        "H100 runs a batch-1 decode.",
        "",
        "| model | weights | layers | ops per layer | compute | torch attention | first layer extra "
        "| outside layers | sampling greedy / T = 0.7 | decode step total |",
        "|---" * 10 + "|",
    ]
    for r in layers:
        lines.append(
            f"| {r['model']} | {r['format']} | {r['layers']} | **{r['per_layer']}** "
            f"| {r['per_layer_compute']} | {r['torch_attention']} | {r['first_layer_extra']} "
            f"| {r['outside_layers']} | {r['sampling_greedy']} / {r['sampling_t07']} | {r['step_total']} |"
        )
    names = [f"{r['model']} {r['format']}" for r in layers]
    ops = sorted(
        {op for r in layers for op in r["by_op"]},
        key=lambda op: (-layers[0]["by_op"].get(op, 0), op),
    )
    lines += [
        "",
        "### Which ops, one decoder layer",
        "",
        "| op (kind) | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    lines += [
        f"| {op} | " + " | ".join(str(r["by_op"].get(op, 0)) for r in layers) + " |" for op in ops
    ]
    lines += [
        "",
        f"### Where the target's {layers[0]['per_layer']} come from (one decoder layer)",
        "",
        "| call site | op (kind) | calls |",
        "|---|---|---|",
    ]
    return (
        lines
        + [
            f"| {s['site']} | {s['op']} ({s['kind']}) | {s['calls']} |"
            for s in layers[0]["by_site"]
        ]
        + [""]
    )


def prefill_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        f"## Host launches of a {rows[0]['tokens']}-token prefill chunk, GPU path: eager vs piecewise graphs",
        "",
        "A step no whole-step graph holds (prefill chunks, prefill batched with decode rows) replays piecewise "
        "graphs (runtime/piecewise_graphs.py): the work between two attentions as one graph, each replay one "
        "launch; RoPE + K/V write and attention stay eager. Launches: compute ops and replays the host issues; "
        "ops: all it dispatches, views included. Per layer: 3 layers minus 2; step: at the model's depth.",
        "",
        "| model | layers | eager launches per layer / step | piecewise launches per layer / step "
        "| eager ops per layer / step | piecewise ops per layer / step |",
        "|---" * 6 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['eager_launches_per_layer']} / {r['eager_launches']} "
            f"| **{r['piecewise_launches_per_layer']} / {r['piecewise_launches']}** "
            f"| {r['eager_ops_per_layer']} / {r['eager_ops']} "
            f"| {r['piecewise_ops_per_layer']} / {r['piecewise_ops']} |"
        )
    return lines + [""]


def engine_lines(rows: list[dict]) -> list[str]:
    lines = [
        f"## Per engine step on a tiny pair (goal: {GOAL_SYNCS_PER_ROUND} sync per round)",
        "",
        "A step is one token for AR and one round (K drafts, one verification) for SD and SSD; SSD counts "
        "the coordinator's side (the draft is another process). Syncs are host reads of would-be device "
        "tensors (tests/instrumentation/sync_count.py). Medians over the counted steps.",
        "",
        "| mode | T | K | ops per step | compute | in decoder layers (target / draft layer calls) "
        "| other ops | syncs per step |",
        "|---" * 8 + "|",
    ]
    for r in rows:
        o = r["ops_steps"]
        syncs = [s["syncs"] for s in r["sync_steps"]]
        spread = f" ({min(syncs)}-{max(syncs)})" if min(syncs) != max(syncs) else ""
        lines.append(
            f"| {r['mode']} | {r['temperature']} | {r['k'] or '-'} | {_median(o, 'ops')} "
            f"| {_median(o, 'compute_ops')} | {_median(o, 'layer_ops')} ({_median(o, 'target_layer_calls')}"
            f" / {_median(o, 'draft_layer_calls')}) | {_median(o, 'other_ops')} "
            f"| **{_median(r['sync_steps'], 'syncs')}**{spread} |"
        )
    lines += [
        "",
        "### Syncs by call site (per step, the last counted step)",
        "",
        "| mode | T | kind @ call site | syncs |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines += [
            f"| {r['mode']} | {r['temperature']} | {site} | {n} |"
            for site, n in r["sync_steps"][-1]["syncs_by_site"].items()
        ]
    return lines


def _commit() -> str:
    sys.path.insert(0, HERE)
    from suite.machine import git_commit

    return git_commit()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target model folder (default: the built-in pair's)")
    parser.add_argument("--draft", help="draft model folder (default: the built-in pair's)")
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help="draft weight formats to count"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="engine modes to count per step (tiny pair)"
    )
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument(
        "--steps", type=int, default=3, help="steps counted per mode, temperature and counter"
    )
    parser.add_argument("--engine-draft-dtype", default="int4", help="the tiny pair's draft format")
    parser.add_argument(
        "--out", default=os.path.join(HERE, "results"), help="folder for DATE-ops.md / .json"
    )
    parser.add_argument(
        "--no-gpu-path",
        dest="gpu_path",
        action="store_false",
        help="skip counting the GPU path (Triton kernels under the interpreter)",
    )
    opts = parser.parse_args(argv)
    opts.formats = [f for f in opts.formats.split(",") if f]
    opts.modes = [m for m in opts.modes.split(",") if m]
    bad = [f for f in opts.formats if f not in FORMATS] + [m for m in opts.modes if m not in MODES]
    if bad:
        parser.error(f"unknown format or mode {bad[0]!r}")
    return opts


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse(argv)
    from instrumentation.op_count import without_row_padding

    from ssd_engine.models.default_models import resolve_default_model
    from ssd_engine.utils.machine import describe

    target = opts.target or resolve_default_model("target")
    draft = opts.draft or resolve_default_model("draft")
    with without_row_padding(), tempfile.TemporaryDirectory() as root:
        layers = model_rows(target, draft, opts.formats, opts.gpu_path)
        prefill = (
            [
                {"model": name, **prefill_launches(path)}
                for name, path in (("target", target), ("draft", draft))
            ]
            if opts.gpu_path
            else []
        )
        engine = engine_rows(
            *tiny_pair(root), opts.modes, opts.k, opts.steps, opts.engine_draft_dtype
        )
    stamp = datetime.date.today().isoformat()
    raw = {
        "date": stamp,
        "cpu": describe(),
        "commit": _commit(),
        "command": " ".join(["python benchmarks/profiling/bench_ops.py", *argv]),
        "target": os.path.basename(target.rstrip("/")),
        "draft": os.path.basename(draft.rstrip("/")),
        "layers": layers,
        "prefill": prefill,
        "engine": engine,
    }
    text = render(raw)
    print(text)
    os.makedirs(opts.out, exist_ok=True)
    base = os.path.join(opts.out, f"{stamp}-ops")
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump(raw, f, indent=1)
    print(f"wrote {base}.md, {base}.json", file=sys.stderr)
    return raw


if __name__ == "__main__":
    main()
