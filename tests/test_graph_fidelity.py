"""Emulated CUDA graphs replay what real ones would (tests/instrumentation/graph_fidelity.py).

The emulation calls the Python forward again at every replay; a real graph replays its capture's
launches. Each class of code that passes the first and breaks the second must raise here, a
forward that only reads its static buffers must not, and the engine's own graphed steps (paged,
tree and piecewise, under tensor parallelism too) run checked in every CI run without a GPU
(conftest turns the check on).
"""

import pytest
import torch
from instrumentation import graph_fidelity
from instrumentation.graph_fidelity import GraphInfidelity, emulated_graph

from ssd_engine import testing
from ssd_engine.runtime.cuda_graphs import GraphRunner
from ssd_engine.utils.launches import kernel_launch


def _static():
    """A static input and a weight: what a captured forward may read."""
    return torch.arange(6, dtype=torch.float32), torch.full((6,), 2.0)


def test_a_forward_reading_only_its_static_buffers_replays_clean():
    x, w = _static()
    graph = emulated_graph(lambda: torch.relu(x * w + 1).sum(0, keepdim=True), "clean")
    first = graph()
    x.copy_(-x)  # new values in the static buffer: what a real replay reads
    assert torch.equal(first, torch.tensor([36.0])) and torch.equal(graph(), torch.tensor([1.0]))
    graph()


def test_the_engine_checks_its_graphs_only_when_a_checker_is_named(monkeypatch):
    forward = lambda: None  # noqa: E731
    monkeypatch.delenv(testing.GRAPH_CHECKER, raising=False)
    assert testing.checked_graph(forward, "off") is forward
    monkeypatch.setenv(testing.GRAPH_CHECKER, graph_fidelity.SPEC)
    checked = testing.checked_graph(lambda: torch.ones(1).item(), "on")
    with pytest.raises(GraphInfidelity, match="graph on: host read"):
        checked()


@pytest.mark.parametrize("read", ["item", "bool", "tolist", "nonzero", "mask_index", "upload"])
def test_a_host_read_inside_the_capture_is_refused(read):
    x, _ = _static()
    body = {
        "item": lambda: x * x.max().item(),
        "bool": lambda: x * 2 if bool(x.sum() > 0) else x,
        "tolist": lambda: x[: len(x.tolist())],
        "nonzero": lambda: x.nonzero(),
        "mask_index": lambda: x[x > 2],
        "upload": lambda: x + torch.tensor([1.0], device=x.device),
    }[read]
    with pytest.raises(
        GraphInfidelity,
        match=r"graph g: host read .* inside the captured region at .*test_graph_fidelity",
    ):
        emulated_graph(body, "g")()


def test_a_replay_taking_another_branch_is_refused():
    x, w = _static()
    state = {"fused": True}
    graph = emulated_graph(lambda: x * w if state["fused"] else torch.mul(x, 3.0), "branch")
    graph()
    state["fused"] = False  # changed after the capture: a real graph still multiplies by w
    with pytest.raises(
        GraphInfidelity,
        match=r"graph branch: replay diverged from the capture at launch 0: "
        r"captured aten.mul.Tensor .* with other arguments",
    ):
        graph()


def test_a_replay_reading_a_tensor_the_capture_did_not_is_refused():
    """The capture read one step's tensor, not a static buffer: a real replay reads that memory again."""
    steps = iter([torch.ones(6), torch.full((6,), 5.0)])
    current = {}
    graph = emulated_graph(lambda: current["x"] * 2, "per-step input")
    current["x"] = next(steps)
    graph()
    current["x"] = next(steps)
    with pytest.raises(GraphInfidelity, match="replay diverged from the capture at launch 0"):
        graph()


def test_a_replay_of_another_size_or_length_is_refused():
    x, _ = _static()
    n = {"rows": 4}
    graph = emulated_graph(lambda: x[: n["rows"]] + 1, "size")
    graph()
    n["rows"] = 5
    with pytest.raises(GraphInfidelity, match="size"):
        graph()
    extra = {"on": False}
    longer = emulated_graph(lambda: (x + 1) * 2 if extra["on"] else x + 1, "length")
    longer()
    extra["on"] = True
    with pytest.raises(
        GraphInfidelity, match=r"graph length: the capture launched 1 kernels and ops, the replay 2"
    ):
        longer()


def test_a_kernel_is_one_launch_whatever_it_runs_inside():
    """A Triton launch under the interpreter copies through numpy: those ops are not the graph's."""
    x, w = _static()
    calls = {"n": 0}

    def forward():
        out = torch.empty_like(x)
        with kernel_launch("double", x, out):
            calls["n"] += 1
            out.copy_(
                x * (2 if calls["n"] == 1 else 2.0)
            )  # host-side differences inside the kernel
        return out * w

    graph = emulated_graph(forward, "kernel")
    graph(), graph()
    kernels = {"n": 0}

    def other_kernel():
        kernels["n"] += 1
        with kernel_launch("double" if kernels["n"] == 1 else "triple", x):
            pass

    other = emulated_graph(other_kernel, "kernels")
    other()
    with pytest.raises(GraphInfidelity, match="captured kernel double .* replayed kernel triple"):
        other()


def test_graph_runner_refuses_a_forward_reading_its_step_values():
    """The engine's graphs, emulated: a forward that sizes its work from kv_lens' values fails on capture."""

    def forward(input_ids, positions, meta):
        return torch.zeros(input_ids.shape[0], 4) + meta.kv_lens[: int(meta.kv_lens.max())].sum()

    runner = GraphRunner(
        forward,
        cap=2,
        max_blocks=2,
        block_size=4,
        pad_slot=0,
        device=torch.device("cpu"),
        capture="emulate",
    )
    with pytest.raises(
        GraphInfidelity, match=r"graph 1-token paged step x 2 rows: host read 'int'"
    ):
        runner.capture_all([("paged", 1)])
