"""Host time per engine step outside graph replays, on the GPU path (issue 22: the host work to launch
a graphed step must stay well under the step's GPU time).

    python benchmarks/gpu/bench_host_overhead.py                  # AR and SD, greedy and T = 0.7
    python benchmarks/gpu/bench_host_overhead.py --steps 20 --k 4

On CPU the GPU path is emulated: Triton attention and the fused layer kernels under Triton's
interpreter, CUDA graphs replayed by re-running the forward on their static buffers. The replays
are the GPU's share (slow here, and not measured); everything else a step does is work a GPU's
host does too: scheduling, the step's inputs and their upload, the static-buffer fills, the LM
head's and sampling's launches, verification, output processing. So host time = a step's wall time
minus the time inside replay calls (GraphRunner / PiecewiseGraphs `replay_seconds`), per step and
per forward. A tiny pair keeps the eager work outside the graphs (the LM head, sampling) near a
GPU launch's cost; the figures scale with the host CPU's single-thread speed. SSD is left out: its
draft's replays run beside the coordinator's. Writes benchmarks/results/DATE-host-overhead.md.

The interpreted replays between two steps evict the host's caches, which a GPU's launches do not:
the same engine then runs as many steps again with every replay skipped (`skip_replays`), the
closer figure for a GPU's host. In that pass `ReadToLaunch` also times the one stretch a GPU cannot
hide behind its own work: from the round's read of its emitted tokens (the host waits for the
device to drain) to the next round's first launch, the device idle in between.
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests"), HERE]


def _runners(engine) -> list:
    """The target's runner and an SD draft's (it runs in this process)."""
    draft = getattr(engine.speculator, "runner", None)
    return [engine.runner.local] + ([draft] if draft is not None else [])


def _graph_runners(engine) -> list:
    return [g for r in _runners(engine) for g in (r.graphs, r.piecewise) if g is not None]


class HeadTimer:
    """Seconds inside the LM heads' forwards: on CPU a real matmul (oneDNN, ~0.1-0.3 ms even at the
    tiny pair's size), on a GPU one launch; reported apart so it can be taken out."""

    def __init__(self, heads) -> None:
        self.seconds, self._started = 0.0, 0.0
        for head in heads:
            head.register_forward_pre_hook(self._start)
            head.register_forward_hook(self._stop)

    def _start(self, *_) -> None:
        self._started = time.perf_counter()

    def _stop(self, *_) -> None:
        self.seconds += time.perf_counter() - self._started


def skip_replays(graphs: list) -> None:
    """From now on every graph replay does nothing and its static output keeps its last values, a
    bucket first needed later still runs once: what a GPU's host does around a replay, without the
    interpreter's work between two steps evicting the host's caches (the run's tokens are then
    meaningless; a step's host work does not depend on them beyond the accepted counts)."""
    from ssd_engine.runtime.piecewise_graphs import PiecewiseGraphs

    for g in graphs:
        if isinstance(g, PiecewiseGraphs):
            g.graphs = {size: [_nothing] * len(replays) for size, replays in g.graphs.items()}
            continue
        g.graphs = {key: (_nothing, out) for key, (_, out) in g.graphs.items()}
        capture = g._capture
        g._capture = lambda family, size, capture=capture: (
            _nothing,
            _ran_once(*capture(family, size)),
        )


def _nothing() -> None:
    ReadToLaunch.launched()


class ReadToLaunch:
    """While entered: each step's host time from the last host read (`Tensor.tolist`, how the engine
    reads its emitted tokens) to the first launch after it: a host-to-device copy (every step's inputs
    go up in one) or a (skipped) graph replay. Patched methods rather than a torch mode: a mode would
    slow every op in the stretch it times."""

    active: "ReadToLaunch | None" = None

    def __init__(self) -> None:
        self.read_at: float | None = None
        self.gaps: list[float] = []

    @classmethod
    def launched(cls) -> None:
        timer = cls.active
        if timer is not None and timer.read_at is not None:
            timer.gaps.append(time.perf_counter() - timer.read_at)
            timer.read_at = None

    def __enter__(self) -> "ReadToLaunch":
        import torch

        self._tolist, self._copy = torch.Tensor.tolist, torch.Tensor.copy_
        tolist, copy = self._tolist, self._copy

        def timed_tolist(tensor, *args):
            values = tolist(tensor, *args)
            self.read_at = time.perf_counter()
            return values

        def timed_copy(tensor, *args, **kwargs):
            ReadToLaunch.launched()
            return copy(tensor, *args, **kwargs)

        torch.Tensor.tolist, torch.Tensor.copy_ = timed_tolist, timed_copy
        ReadToLaunch.active = self
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.Tensor.tolist, torch.Tensor.copy_ = self._tolist, self._copy
        ReadToLaunch.active = None


def _ran_once(replay, out):
    replay()
    return out


def _host_seconds(engine, graphs: list, heads: "HeadTimer", steps: int) -> tuple[list, list, list]:
    """Per step: host seconds (wall minus replays), of which in the LM heads, and forwards replayed."""
    host, head, forwards = [], [], []
    for _ in range(steps):
        replayed, in_head = sum(g.replay_seconds for g in graphs), heads.seconds
        calls = sum(sum(g.replayed.values()) for g in graphs)
        started = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - started
        host.append(wall - (sum(g.replay_seconds for g in graphs) - replayed))
        head.append(heads.seconds - in_head)
        forwards.append(sum(sum(g.replayed.values()) for g in graphs) - calls)
    return host, head, forwards


def _read_to_launch(engine, steps: int) -> list[float]:
    """Per step (replays skipped), the longest stretch from a read to the next launch: the one after the
    round's read of its tokens (a step's other reads are of host tensors, a launch or so before one)."""
    longest = []
    with ReadToLaunch() as timer:
        for _ in range(steps + 1):
            before = len(timer.gaps)
            engine.step()
            longest.append(max(timer.gaps[before:], default=0.0))
    return longest[1:]  # the first step's stretch began before timing did


def _launches(engine) -> int:
    """Compute ops one step dispatches outside the (skipped) replays, row padding off as on a GPU: each
    a kernel launch there. Counted, so it does not drift with the machine as the times do."""
    from instrumentation.op_count import OpCounter, without_row_padding

    ops = OpCounter()
    with without_row_padding(), ops:
        engine.step()
    return ops.total(kind="compute")


def measure(
    target: str, draft: str, mode: str, temperature: float, k: int, steps: int, device: str = "cpu"
) -> dict:
    from ssd_engine import LLM, SamplingParams
    from ssd_engine.testing import emulated_cuda_graphs

    options = dict(
        speculative_mode=mode,
        num_threads=1,
        max_model_len=512,
        attention_backend="triton",
        fused_kernels="on",
        device=device,
        dtype="float32",
    )
    if mode == "sd":
        options.update(draft_model=draft, num_speculative_tokens=k, draft_dtype="fp32")
    with emulated_cuda_graphs(device == "cpu"):  # a GPU captures real graphs
        llm = LLM(target, **options)
    with llm:
        engine = llm.engine
        engine.add_request(
            list(range(3, 20)),
            SamplingParams(temperature=temperature, seed=0, max_tokens=400, ignore_eos=True),
        )
        for _ in range(3):  # prefill, first rounds: graphs made
            engine.step()
        graphs = _graph_runners(engine)
        heads = HeadTimer([runner.model.lm_head for runner in _runners(engine)])
        host, head, forwards = _host_seconds(engine, graphs, heads, steps)
        skip_replays(graphs)
        skipped, skipped_head, _ = _host_seconds(engine, graphs, heads, steps)
        gaps = _read_to_launch(engine, steps)
        launches = statistics.median(_launches(engine) for _ in range(3))
    per_step = statistics.median(host)
    without_head = statistics.median(h - m for h, m in zip(host, head))
    per_forward = statistics.median((h - m) / f for h, m, f in zip(host, head, forwards) if f)
    warm = statistics.median(h - m for h, m in zip(skipped, skipped_head))
    return {
        "mode": mode,
        "temperature": temperature,
        "k": k if mode == "sd" else None,
        "host_us_per_step": round(per_step * 1e6),
        "lm_head_us_per_step": round(statistics.median(head) * 1e6),
        "host_us_per_step_without_head": round(without_head * 1e6),
        "forwards_per_step": statistics.median(forwards),
        "host_us_per_forward": round(per_forward * 1e6),
        "host_us_per_step_replays_skipped": round(warm * 1e6),
        "launches_outside_replays": launches,
        "read_to_launch_us": round(statistics.median(gaps) * 1e6),
    }


def render(rows: list[dict], machine: str, command: str, device: str = "cpu") -> str:
    where = (
        "GPU path emulated"
        if device == "cpu"
        else f"on {device} (the 'host us per step' columns then "
        "hold the step's wall time: the round's read waits for the GPU; replays skipped: the host's own work)"
    )
    lines = [
        f"# Host time per step outside graph replays, {where}, {datetime.date.today()}",
        "",
        f"- Machine: {machine}",
        f"- Command: `{command}`",
        "- Tiny pair (proxy_counts.tiny_pair), batch 1, 1 thread; medians over the measured steps",
        "",
        "| mode | T | K | host us per step | of which LM head matmuls (CPU only) | host us per step "
        "without them | forwards per step | host us per forward without the LM head "
        "| host us per step without them, replays skipped | launches outside the replays per step "
        "| host us from the read to the next launch (the device idle) |",
        "|---" * 11 + "|",
    ]
    lines += [
        f"| {r['mode']} | {r['temperature']} | {r['k'] or '-'} | {r['host_us_per_step']} "
        f"| {r['lm_head_us_per_step']} | **{r['host_us_per_step_without_head']}** "
        f"| {r['forwards_per_step']:g} | {r['host_us_per_forward']} "
        f"| {r['host_us_per_step_replays_skipped']} | {r['launches_outside_replays']:g} "
        f"| {r['read_to_launch_us']} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu/bench_host_overhead.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--modes", default="ar,sd")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument(
        "--device", default="cpu", help="cpu (the GPU path emulated) or cuda (real graphs)"
    )
    opts = parser.parse_args(argv)
    if unknown := [m for m in opts.modes.split(",") if m not in ("ar", "sd")]:
        parser.error(f"--modes: unknown mode {unknown[0]!r}; choose from ar, sd")
    if opts.device != "cpu" and not opts.device.startswith("cuda"):
        parser.error(f"--device must be cpu or cuda, got {opts.device!r}")
    return opts


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse(argv)
    if opts.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are imported
    from instrumentation.proxy_counts import tiny_pair
    from suite.machine import machine_line

    with tempfile.TemporaryDirectory() as root:
        target, draft = tiny_pair(root)
        rows = [
            measure(target, draft, mode, t, opts.k, opts.steps, opts.device)
            for mode in opts.modes.split(",")
            for t in (0.0, 0.7)
        ]
    text = render(
        rows,
        machine_line(opts.device),
        " ".join(["python benchmarks/gpu/bench_host_overhead.py", *argv]),
        opts.device,
    )
    print(text)
    os.makedirs(opts.out, exist_ok=True)
    suffix = "" if opts.device == "cpu" else f"-{opts.device.split(':')[0]}"
    with open(
        os.path.join(opts.out, f"{datetime.date.today()}-host-overhead{suffix}.md"), "w"
    ) as f:
        f.write(text)
    return rows


if __name__ == "__main__":
    main()
