"""Device placement checked on CPU (tests/instrumentation/placement.py): what a GPU run would reject.

The first GPU run failed on host tensors handed to Triton kernels by paths only ever run on CPU. The
checker reports each rule's violation here, the engine's GPU paths (Triton attention, the fused layer
kernels, graphed steps; SD and SSD with the draft thread checked too) come out clean, and a step whose
host values never cross to the device is caught.
"""

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from cpu_features import GPU_DRAFT_DTYPE_ON_CPU  # noqa: E402
from instrumentation.placement import Place, PlacementChecker  # noqa: E402
from placement_harness import gpu_placement  # noqa: E402

from ssd_engine import LLM, SamplingParams, testing  # noqa: E402
from ssd_engine.runtime import step_tensors  # noqa: E402
from ssd_engine.utils.launches import kernel_launch  # noqa: E402

DEVICE = torch.device("cpu")  # a device object: what the checker takes for the accelerator
PROMPTS = [list(range(5, 12)), list(range(40, 52)), [7, 8, 9]]
# one layer runs every kernel a deeper model runs (its norms take the residual and the no-residual
# paths), and where a tensor lives does not depend on the layer: the Triton interpreter's time does
ONE_LAYER = dict(vocab_size=259, num_hidden_layers=1)


def _found(checker: PlacementChecker) -> set[tuple[str, str]]:
    return {(kind, what) for kind, what, _ in checker.findings}


def test_an_op_mixing_host_and_device_tensors_is_reported():
    with PlacementChecker() as checker:
        device, host = torch.ones(3, device=DEVICE), torch.ones(3)
        device + device, host + host
        device * torch.tensor(2.0)  # a host 0-dim tensor is a scalar CUDA accepts
        assert not checker.findings
        device + host
    assert _found(checker) == {("mixed", "add")}


def test_moves_make_new_tensors_and_the_original_stays_on_the_host():
    with PlacementChecker() as checker:
        host = torch.arange(4.0)
        moved = host.to(DEVICE)
        back = moved.cpu()
        assert [checker.place(t) for t in (host, moved, back)] == [
            Place.HOST,
            Place.DEVICE,
            Place.HOST,
        ]
        moved.copy_(host), back + host  # a copy may cross; the host copy meets host tensors
        assert not checker.findings
        moved + host
    assert _found(checker) == {("mixed", "add")}


def test_host_indices_are_fine_host_values_are_not():
    with PlacementChecker() as checker:
        device, host = torch.zeros(6, device=DEVICE), torch.ones(6)
        index = torch.tensor([0, 2])
        device[index], device[:2]
        device[:2] = host[:2]  # a slice assignment is a copy
        assert not checker.findings
        device[index] = host[:2]  # an index_put: its values must be on the device
    assert _found(checker) == {("mixed", "__setitem__")}


def test_a_kernel_handed_a_host_tensor_is_reported_with_its_position():
    with PlacementChecker() as checker:
        device, host = torch.ones(2, device=DEVICE), torch.ones(2)
        with kernel_launch("some_kernel", device, device):
            pass
        assert not checker.findings
        with kernel_launch("some_kernel", device, host):
            pass
    assert _found(checker) == {("kernel", "some_kernel (host tensors 1)")}
    assert checker.kernels_checked["MainThread"] == 2


def test_modules_built_on_the_device_hold_device_parameters_and_their_views():
    with PlacementChecker() as checker:
        with torch.device(DEVICE):
            layer = nn.Linear(4, 3)
        weight_rows = layer.weight[1:]
        assert {checker.place(t) for t in (layer.weight, layer.bias, weight_rows)} == {Place.DEVICE}
        layer(torch.ones(2, 4, device=DEVICE))
        assert not checker.findings
        layer(torch.ones(2, 4))
    assert ("mixed", "linear") in _found(checker)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv(testing.EMULATE_CUDA_GRAPHS, "1")  # the graphed steps' static-buffer path


def _engine_options(path: str, mode: str) -> dict:
    options = dict(
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        fused_kernels="on",
        block_size=4,
        cuda_graph_max_batch=4,
    )
    if mode != "ar":
        # a GPU's draft format (cpu_features.py); the thread: checked like the target
        options.update(
            draft_model=path,
            speculative_mode=mode,
            num_speculative_tokens=3,
            draft_dtype=GPU_DRAFT_DTYPE_ON_CPU,
            ssd_fanout="1",
            ssd_budget=4,
            ssd_draft_host="thread",
            draft_timeout_s=300,
        )
    return options


PARAMS = [
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=3, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.8, top_k=20, max_tokens=5, ignore_eos=True),
]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_the_engines_gpu_paths_hand_the_device_only_device_tensors(tiny_model_dir, emulated, mode):
    path = tiny_model_dir("qwen2", **ONE_LAYER)
    with gpu_placement() as checker, LLM(path, **_engine_options(path, mode)) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        metrics = llm.speculation_metrics()
    assert [len(o.token_ids) for o in outputs] == [5] * 3
    assert not checker.findings, "\n".join(checker.report())
    assert checker.kernels_checked["MainThread"] > 0  # the target's launches were seen
    if mode == "ssd":
        assert checker.kernels_checked["ssd-draft"] > 0 and not metrics["draft_failures"]


def test_a_step_whose_host_values_never_cross_is_caught(tiny_model_dir, emulated, monkeypatch):
    """The deliberately broken control: the target's step inputs left on the host, as a path tested
    only on CPU could leave them. On a GPU its kernels would get host pointers."""
    monkeypatch.setattr(
        step_tensors,
        "upload",
        lambda columns, device, dtype=torch.long: [
            torch.tensor(column, dtype=dtype) for column in columns
        ],
    )
    path = tiny_model_dir("qwen2", **ONE_LAYER)
    with gpu_placement() as checker, LLM(path, **_engine_options(path, "ar")) as llm:
        llm.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)
    kernels = {what.split(" ")[0] for kind, what in _found(checker) if kind == "kernel"}
    assert {"paged_attention", "rope_cache_write"} <= kernels
