"""The model's forward as one compiled region (torch.compile, inductor): EngineConfig.compile_model.

Why: an eager one-token step dispatches 36 aten ops per decoder layer (19 of them compute: the
norms, RoPE's roll and arithmetic, the matmuls, SiLU-mul, residual adds, the KV-cache writes and
the attention reference), each a launch on a GPU and a few microseconds of host time anywhere. Compiled, a layer is 9 or 10 kernels: its four matmuls and the attention op
(extern calls) and four fused ones (residual + RMSNorm twice, RoPE, SiLU-mul; one more padding the
attention output where one-row matmuls are padded).

What is compiled: `DecoderModel.forward` whole (embedding, every layer, final norm) as ONE region,
because each call of a compiled region costs its guards and wrappers (~40 us on a CPU): one region
per layer kept about half the gain (benchmarks/results/2026-11-23-compiled-step.md). Attention stays
eager inside it, as the opaque op of layers/compiled_ops.py; the LM head and sampling stay outside.

Shapes: only the token count T varies. T = 1 (decode) compiles with T static; T above the largest
row count row padding pads (layers/row_padding.py; 0 where nothing is padded) compiles once with T
dynamic and serves verification (K + 1 per row), SSD branch steps (B rows) and prefill chunks. T in
between (2 or 3 tokens where oneDNN's small-row kernel is padded) runs eagerly rather than pay a
compile per count. So a model compiles at most twice; the runner does both at start-up (`warm_up`).

Guards: dynamo re-checks every attribute of the model on each call (~190 guards a layer, ~45 us a
layer on the results' CPU). The model never changes after loading, so guards on modules are dropped, and
each model gets its own copy of the function's code object: dynamo keeps compiled graphs per code
object, and with those guards gone a graph must never be offered to another model of the class.

Device: nothing here is CPU-specific. On CUDA inductor emits Triton where it emits C++ on a CPU, and
the compiled forward is what the CUDA graphs capture (runtime/cuda_graphs.py). A step wider than the
32-bit indexing bound (`_max_tokens`, ~10^5 tokens at real shapes) runs eagerly. Tensor parallelism
stays eager: its all-reduces are not traced.
"""
import itertools
import time
import types

import torch

from ssd_engine.layers import row_padding
from ssd_engine.layers.compiled_ops import attention_step
from ssd_engine.layers.embedding import VocabParallelEmbedding
from ssd_engine.layers.weight_formats import OneDNNWeight

MAX_TOKENS = 1 << 30  # the dynamic graph's bound on T (torch 2.13 needs one with a lower bound)
INDEX_LIMIT = 2**31 - 1  # inductor's Triton kernels index with 32 bits: T x a row's width must stay below
_copies = itertools.count()


class CompiledModel:
    """Calls like the DecoderModel it wraps: (input_ids, positions, meta) -> hidden [T, H]."""

    def __init__(self, model) -> None:
        self.model = model
        self.attentions = [layer.self_attn.attn for layer in model.layers]
        # steps of 2..padded tokens take oneDNN's padded small-row path, one static graph per count
        self.padded = max([row_padding.largest_padded(module.prepared.dtype) for module in model.modules()
                           if isinstance(getattr(module, "prepared", None), OneDNNWeight)], default=0)
        options = {}
        if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # older torch: every guard stays
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        self.compiled = torch.compile(_own_copy(type(model).forward), fullgraph=True, options=options)
        self.compile_seconds = 0.0
        self.max_tokens = _max_tokens(model)

    def compiles(self, tokens: int) -> bool:
        return tokens == 1 or self.padded < tokens <= self.max_tokens

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        tokens = input_ids.shape[0]
        if not self.compiles(tokens):
            return self.model(input_ids, positions, meta)
        if tokens > 1:  # one graph for every larger step, instead of one per token count
            for tensor in (input_ids, positions):
                torch._dynamo.mark_dynamic(tensor, 0, min=max(2, self.padded + 1), max=self.max_tokens)
        with attention_step(self.attentions, meta):
            return self.compiled(self.model, input_ids, positions, None)

    def warm_up(self, step) -> None:
        """Compile both graphs now: `step(tokens)` runs a throwaway forward of that many tokens."""
        started = time.perf_counter()
        for tokens in (1, self.padded + 1 if self.padded else 2):
            step(tokens)
        self.compile_seconds = time.perf_counter() - started


def _max_tokens(model) -> int:
    """The dynamic T's upper bound: every value in range must satisfy the guards inductor adds for
    32-bit indexing (T x the widest per-token row, a projection's output, below INDEX_LIMIT), or
    dynamo refuses the graph. The embedding's vocabulary dimension is a table's, not a row's."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    widest = max((max(p.shape) for p in model.parameters() if p.dim() == 2 and id(p) not in tables), default=1)
    return min(MAX_TOKENS, INDEX_LIMIT // widest)


def _own_copy(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own, so dynamo's graphs for it belong to one model."""
    code = function.__code__.replace(co_name=f"{function.__name__}_compiled_{next(_copies)}")
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__,
                              function.__closure__)
