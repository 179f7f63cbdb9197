"""`DecoderModel.forward` as one compiled region (torch.compile): EngineConfig.compile_model.
One region, not one per layer, since each call pays guards and wrappers. Attention stays eager
inside it (layers/compiled_ops.py). T = 1 compiles static, T above the row-padded counts compiles
once dynamic, T between runs eagerly: at most two compiles. Module guards are dropped (the model
never changes), so each model gets its own code object and never shares another model's graphs."""

import itertools
import time
import types

import torch

from ssd_engine.layers import row_padding
from ssd_engine.layers.compiled_ops import attention_step
from ssd_engine.layers.embedding import VocabParallelEmbedding
from ssd_engine.layers.weight_formats import OneDNNWeight

MAX_TOKENS = 1 << 30  # the dynamic graph's bound on T (torch needs one with a lower bound)
# inductor's Triton kernels index with 32 bits: T x a row's width must stay below
INDEX_LIMIT = 2**31 - 1
_copies = itertools.count()


class CompiledModel:
    """Calls like the DecoderModel it wraps: (input_ids, positions, meta) -> hidden [T, H]."""

    def __init__(self, model) -> None:
        self.model = model
        self.attentions = [layer.self_attn.attn for layer in model.layers]
        # steps of 2..padded tokens take oneDNN's padded small-row path and run eagerly
        self.padded = max(
            [
                row_padding.largest_padded(module.prepared.dtype)
                for module in model.modules()
                if isinstance(getattr(module, "prepared", None), OneDNNWeight)
            ],
            default=0,
        )
        options = {}
        # older torch: every guard stays
        if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        self.compiled = torch.compile(
            _own_copy(type(model).forward), fullgraph=True, options=options
        )
        self.compile_seconds = 0.0
        self.max_tokens = _max_tokens(model)

    def compiles(self, tokens: int) -> bool:
        return tokens == 1 or self.padded < tokens <= self.max_tokens

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        tokens = input_ids.shape[0]
        if not self.compiles(tokens):
            return self.model(input_ids, positions, meta)
        if tokens > 1:
            for tensor in (input_ids, positions):
                torch._dynamo.mark_dynamic(
                    tensor, 0, min=max(2, self.padded + 1), max=self.max_tokens
                )
        with attention_step(self.attentions, meta):
            return self.compiled(self.model, input_ids, positions, None)

    def warm_up(self, step) -> None:
        """Compile both graphs now: `step(tokens)` runs a throwaway forward of that many tokens."""
        started = time.perf_counter()
        for tokens in (1, self.padded + 1 if self.padded else 2):
            step(tokens)
        self.compile_seconds = time.perf_counter() - started


def _max_tokens(model) -> int:
    """The dynamic T's upper bound: T x the widest per-token row (not embedding) < INDEX_LIMIT."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    widest = max(
        (max(p.shape) for p in model.parameters() if p.dim() == 2 and id(p) not in tables),
        default=1,
    )
    return min(MAX_TOKENS, INDEX_LIMIT // widest)


def _own_copy(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own, so dynamo's graphs for it belong to one model."""
    code = function.__code__.replace(co_name=f"{function.__name__}_compiled_{next(_copies)}")
    return types.FunctionType(
        code, function.__globals__, code.co_name, function.__defaults__, function.__closure__
    )
