"""Opaque ops a compiled step (runtime/compiled_model.py) must leave as they are.
- `onednn_linear`: inductor lowers `mkldnn._linear_pointwise` only for weights it packed itself.
- `paged_attention`: K/V write and attention stay eager, so the paged cache never becomes a graph
  input (its writes would become copies). Pure: no graph op reads the cache; q, k, v order it."""

import threading
from contextlib import contextmanager
from typing import Optional

import torch

_step = threading.local()  # one model runs at a time per thread


@contextmanager
def attention_step(attentions, meta):
    """While a compiled forward runs: layer i's attention op runs `attentions[i]` over `meta`."""
    previous = getattr(_step, "current", None)
    _step.current = (attentions, meta)
    try:
        yield
    finally:
        _step.current = previous


@torch.library.custom_op("ssd_engine::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    current = getattr(_step, "current", None)
    if current is None:
        raise RuntimeError(
            "ssd_engine::paged_attention ran outside attention_step: compile the model through "
            "runtime/compiled_model.py, which provides the step's metadata"
        )
    attentions, meta = current
    return attentions[layer].run(q, k, v, meta)


@paged_attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("ssd_engine::onednn_linear", mutates_args=())
def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, packed, bias):
    return x.new_empty(x.shape[0], packed.shape[0])  # a packed weight keeps its [out, in] shape
