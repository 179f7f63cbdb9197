"""Piecewise CUDA graphs: the steps no whole-step graph holds, with attention left eager.

Why: a whole-step graph (runtime/cuda_graphs.py) needs every row to feed the same number of tokens,
so prefill chunks, a prefill batched with decode rows, or any step wider than the graphs' row cap
ran eagerly: with the fused layer kernels about 20 launches a layer, ~600 for the 1.5B target,
where a GPU runs a short chunk in a fraction of that host time. Attention is what cannot be
captured for them: its grid and its work depend on each row's query and key counts.

So the model is cut at its attentions (`DecoderModel.piece`): piece 0 embeds and projects layer 0's
q/k/v; piece i finishes layer i - 1 (o_proj, norm, MLP) and projects layer i's q/k/v; the last piece
finishes the last layer and the final norm. Each piece is one graph per token bucket; between two
replays the layer's RoPE, K/V write and attention run eagerly on the step's real tokens
(`DecoderAttention.attend`: one or two launches with the fused kernels) and their output is copied
into the next piece's static input. A step of T tokens replays the smallest bucket >= T; the rows
past T are padding whose results are dropped (rows never mix outside attention, and attention sees
only the real rows). That is vLLM's design; steps wider than the largest bucket stay eager (their
matmuls outweigh the launches).

Buckets: 8 and then four per doubling up to MAX_TOKENS (8, 16, 24, 32, 40, 48, 56, 64, 80, ...),
so a step is padded by fewer than 8 rows or a quarter of its own. On a GPU every bucket is captured at start-up
(largest first, one memory pool); `capture="emulate"` runs the same static-buffer path on CPU, each
bucket made when first needed (tests).
"""
import time

import torch

from ssd_engine.runtime.graph_check import emulated_graph

MAX_TOKENS = 512
SMALLEST = 8


def token_buckets(largest: int = MAX_TOKENS) -> list[int]:
    sizes, n = [], SMALLEST
    while n < largest:
        sizes.append(n)
        n += max(SMALLEST, 1 << (n.bit_length() - 3))  # a quarter of the power of two at or below n
    return sizes + [largest]


class PiecewiseGraphs:
    def __init__(self, model, *, device: torch.device, capture: str, largest: int | None = None) -> None:
        self.model = model  # a DecoderModel: layers, rotary, piece()
        self.sizes = token_buckets(largest or MAX_TOKENS)
        self.device, self.capture = device, capture
        self.graphs: dict[int, list] = {}  # bucket -> one replay per piece
        # bucket -> the last piece's hidden states: its graph's output, one buffer each replay rewrites
        self.outputs: dict[int, torch.Tensor] = {}
        self.replayed: dict[int, int] = {}  # bucket -> steps it ran (tests, benchmarks)
        self.replay_seconds = 0.0  # host seconds inside replay calls, as GraphRunner's
        self.pool = None
        self._buffers_made = False

    def holds(self, tokens: int) -> bool:
        return 0 < tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Forward one step of `input_ids.shape[0]` tokens -> hidden [T, H], as the model's forward."""
        tokens = input_ids.shape[0]
        size = next(n for n in self.sizes if n >= tokens)
        replays = self._graphs(size)
        self.ids[:tokens].copy_(input_ids)
        rope = self.model.rotary.tables(positions, self.qkv.dtype)
        self._replay(replays[0])
        for layer, replay in zip(self.model.layers, replays[1:]):
            self.attention[:tokens].copy_(layer.self_attn.attend(rope, self.qkv[:tokens], meta))
            self._replay(replay)
        self.replayed[size] = self.replayed.get(size, 0) + 1
        return self.outputs[size][:tokens]

    def _replay(self, replay) -> None:
        started = time.perf_counter()
        replay()
        self.replay_seconds += time.perf_counter() - started

    @torch.inference_mode()  # the mode the steps replay in (the ops dispatched are the same)
    def capture_all(self) -> None:
        """Capture every bucket now (a GPU at start-up), largest first so the smaller ones reuse the pool."""
        for size in reversed(self.sizes):
            self._graphs(size)

    # ---- static buffers and capture -----------------------------------------------------------
    def _make_buffers(self) -> None:
        """Sized for the largest bucket; widths and dtype from piece 0 run on one token."""
        largest = self.sizes[-1]
        self.ids = torch.zeros(largest, dtype=torch.long, device=self.device)
        qkv, residual = self.model.piece(0, self.ids[:1], None)
        attention = self.model.layers[0].self_attn
        self.qkv = qkv.new_zeros(largest, qkv.shape[1])
        self.residual = residual.new_zeros(largest, residual.shape[1])
        self.attention = qkv.new_zeros(largest, attention.num_heads * attention.head_dim)
        self._buffers_made = True

    def _piece(self, index: int, size: int):
        """Run piece `index` on the first `size` rows of the static buffers; write its outputs there
        (the last piece's hidden states are returned: they are the graph's own output)."""
        x = self.ids[:size] if index == 0 else self.attention[:size]
        out, residual = self.model.piece(index, x, None if index == 0 else self.residual[:size])
        if residual is None:
            return out
        self.qkv[:size].copy_(out)
        self.residual[:size].copy_(residual)
        return None

    def _graphs(self, size: int) -> list:
        if size in self.graphs:
            return self.graphs[size]
        if not self._buffers_made:
            self._make_buffers()
        pieces = [lambda index=index: self._piece(index, size) for index in range(len(self.model.layers) + 1)]
        if self.capture == "emulate":  # nothing run ahead (under the interpreter a piece is slow)
            pieces = [emulated_graph(piece, f"piece {index} of the {size}-token bucket")
                      for index, piece in enumerate(pieces)]

            def last():  # a real graph's output is one buffer that each replay rewrites
                out = pieces[-1]()
                if size in self.outputs:
                    self.outputs[size].copy_(out)
                else:
                    self.outputs[size] = out
            self.graphs[size] = pieces[:-1] + [last]
            return self.graphs[size]
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # warm-up off the capture stream (allocator, cuBLAS handles)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for piece in pieces:
                piece()
        stream.wait_stream(side)
        replays = []
        for piece in pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = piece()
            self.pool = graph.pool()
            replays.append(graph.replay)
        self.outputs[size] = out
        self.graphs[size] = replays
        return replays
