"""Device-independent proxies of GPU costs, counted on CPU (issue 22): run it after any change to a
forward, the sampler or the round's bookkeeping.

    python tests/instrumentation/gpu_proxies.py                     # default pair, every draft format
    python tests/instrumentation/gpu_proxies.py --formats int4 --modes sd --steps 2

What it counts (proxy_counts.py): ops per decoder layer in a one-token decode step, target and draft
in each weight format at the real shapes, eager and on the GPU path (`--no-gpu-path` skips it; goal:
<= 10 per layer); host launches of a prefill chunk, eager and with piecewise graphs; ops and syncs per
AR step, SD round and SSD round on a tiny pair (goal: 1 sync per round, the accepted tokens).

Row padding (CPU only, measured per machine) is off while counting: the counts are the same on
every machine. Writes benchmarks/results/DATE-ops.md and .json (with the CPU model).
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
FORMATS = ("fp32", "bf16", "int8", "int4")
MODES = ("ar", "sd", "ssd")
GOAL_OPS_PER_LAYER, GOAL_SYNCS_PER_ROUND = 10, 1


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
        "--out",
        default=os.path.join(REPO, "benchmarks", "results"),
        help="folder for DATE-ops.md / .json",
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
    # the GPU path's kernels on CPU (Triton reads this when they are imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from instrumentation.op_count import without_row_padding
    from instrumentation.proxy_counts import engine_rows, model_rows, prefill_launches, tiny_pair
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
    # the bench suite's report writer and commit line, on the path as a script's
    from suite.dated_report import write_dated_result
    from suite.machine import git_commit

    stamp = datetime.date.today().isoformat()
    raw = {
        "date": stamp,
        "cpu": describe(),
        "commit": git_commit(),
        "command": " ".join(["python tests/instrumentation/gpu_proxies.py", *argv]),
        "target": os.path.basename(target.rstrip("/")),
        "draft": os.path.basename(draft.rstrip("/")),
        "layers": layers,
        "prefill": prefill,
        "engine": engine,
    }
    text = render(raw)
    print(text)
    base = write_dated_result(opts.out, "ops", text, raw)
    print(f"wrote {base}.md, {base}.json", file=sys.stderr)
    return raw


if __name__ == "__main__":
    # as a script: tests/ (the instrumentation package, the tiny pair) and benchmarks/ (the bench
    # suite's commit line) on the path, as under pytest
    sys.path[:0] = [TESTS, os.path.join(REPO, "benchmarks")]
    main()
