"""Piecewise CUDA graphs, attention eager, for steps no whole-step graph holds (uneven rows).
The model is cut at its attentions (`DecoderModel.piece`), whose work depends on each row's query
and key counts. Each piece is one graph per token bucket; RoPE, K/V write and attention run eagerly
between replays on the real tokens. A step of T tokens replays the smallest bucket >= T; padding
rows are dropped (rows never mix outside attention, and attention sees only the real rows)."""

import time

import torch

from ssd_engine.utils.test_hooks import checked_graph

MAX_TOKENS = 512
SMALLEST = 8


def token_buckets(largest: int = MAX_TOKENS) -> list[int]:
    sizes, n = [], SMALLEST
    while n < largest:
        sizes.append(n)
        n += max(SMALLEST, 1 << (n.bit_length() - 3))  # four buckets per doubling
    return sizes + [largest]


class PiecewiseGraphs:
    def __init__(
        self, model, *, device: torch.device, capture: str, largest: int | None = None
    ) -> None:
        self.model = model
        self.sizes = token_buckets(largest or MAX_TOKENS)
        self.device, self.capture = device, capture
        self.graphs: dict[int, list] = {}  # bucket -> one replay per piece
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the last piece's output buffer
        self.replayed: dict[int, int] = {}
        self.replay_seconds = 0.0
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

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now, largest first so the smaller ones reuse the pool."""
        for size in reversed(self.sizes):
            self._graphs(size)

    def _make_buffers(self) -> None:
        largest = self.sizes[-1]
        self.ids = torch.zeros(largest, dtype=torch.long, device=self.device)
        qkv, residual = self.model.piece(0, self.ids[:1], None)
        attention = self.model.layers[0].self_attn
        self.qkv = qkv.new_zeros(largest, qkv.shape[1])
        self.residual = residual.new_zeros(largest, residual.shape[1])
        self.attention = qkv.new_zeros(largest, attention.num_heads * attention.head_dim)
        self._buffers_made = True

    def _piece(self, index: int, size: int):
        """Run piece `index` on the first `size` static rows, writing its outputs there; the last
        piece returns its hidden states (the graph's output)."""
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
        pieces = [
            lambda index=index: self._piece(index, size)
            for index in range(len(self.model.layers) + 1)
        ]
        if self.capture == "emulate":
            pieces = [
                checked_graph(piece, f"piece {index} of the {size}-token bucket")
                for index, piece in enumerate(pieces)
            ]

            def last():  # a real graph's output is one buffer that each replay rewrites
                out = pieces[-1]()
                if size in self.outputs:
                    self.outputs[size].copy_(out)
                else:
                    self.outputs[size] = out

            self.graphs[size] = pieces[:-1] + [last]
            return self.graphs[size]
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # warm-up off the capture stream
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
