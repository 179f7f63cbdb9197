"""The two calls a compiled step (runtime/compiled_model.py) must leave as they are, as opaque ops.

- `onednn_linear`: the matmul of a oneDNN-packed weight (layers/weight_formats.py). Inductor lowers
  `mkldnn._linear_pointwise` only for weights it packed itself while freezing a graph (an assertion
  fails for any other), and ours are packed while loading, so the call goes through as it is. The
  int8 and int4 ops need no wrapper: inductor lowers both to the same extern calls.
- `paged_attention`: a layer's K/V write and its attention backend, which stay eager. They read the
  step's compact metadata (host ints, the reference's masks expanded once per step) and write the
  paged KV cache: neither may become an input of the graph, where writing into a view of the one
  cache tensor would be functionalized into copies of it. The op takes only q, k, v and the layer's
  index; the running model's attention modules and the step's metadata are set around the compiled
  call by `attention_step`. It is declared pure: no op in the graph reads the cache, so the write
  needs no ordering beyond the data flow that already feeds the op its q, k and v.
"""
import threading
from contextlib import contextmanager
from typing import Optional

import torch

_step = threading.local()  # one model runs at a time per thread; an engine runs its models on one


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
        raise RuntimeError("ssd_engine::paged_attention ran outside attention_step: compile the model through "
                           "runtime/compiled_model.py, which provides the step's metadata")
    attentions, meta = current
    return attentions[layer].run(q, k, v, meta)


@paged_attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("ssd_engine::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, packed, bias):
    return x.new_empty(x.shape[0], packed.shape[0])  # a packed weight keeps its [out, in] shape
