"""Owns one model and its paged KV cache: turns a scheduled batch into flat tensors
(runtime/step_tensors.py), runs forward.
Under tensor parallelism every rank runs `run()` on the same StepInputs in lockstep over its slice
of the model and KV heads; only rank 0 gets logits."""

from dataclasses import dataclass, replace

import torch

from ssd_engine.core.config_sections import CacheConfig, ModelConfig
from ssd_engine.core.structures import ScheduledBatch
from ssd_engine.distributed.comm import TPGroup
from ssd_engine.distributed.partition import max_kv_heads_per_rank
from ssd_engine.layers import layer_ops, row_padding
from ssd_engine.layers.attention import (
    AttentionMetadata,
    row_independent_attention,
    torch_attention,
)
from ssd_engine.layers.attention_backends import select_backend
from ssd_engine.layers.shapes import head_dim
from ssd_engine.layers.weight_formats import check_supported
from ssd_engine.models import model_class_for
from ssd_engine.models.gguf_weights import GGUF_FORMATS, gguf_blocks_for
from ssd_engine.models.loader import build_model, config_from_values, config_values, load_config
from ssd_engine.runtime import weight_packing
from ssd_engine.runtime.compiled_model import CompiledModel
from ssd_engine.runtime.cuda_graphs import GraphRunner
from ssd_engine.runtime.piecewise_graphs import PiecewiseGraphs
from ssd_engine.runtime.step_inputs import StepInputs
from ssd_engine.runtime.step_tensors import step_tensors
from ssd_engine.utils.memory import lazy_zeros
from ssd_engine.utils.test_hooks import emulating_cuda_graphs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerSpec:
    """The one way to build a ModelRunner, in plain values so other processes can build one."""

    model: ModelConfig  # path resolved
    cache: CacheConfig  # num_kv_blocks resolved
    max_position: int  # positions the model must cover: max_model_len + K + 1 (drafting and verifying run past it)
    # model.path's config as plain values, so children never import transformers; None: read it
    checkpoint_config: dict | None = None

    def with_model(self, **changes) -> "RunnerSpec":
        """This spec with some ModelConfig fields changed; a new path drops the config read."""
        config = None if "path" in changes else self.checkpoint_config
        return replace(self, model=replace(self.model, **changes), checkpoint_config=config)

    def for_other_processes(self) -> "RunnerSpec":
        """This spec with its checkpoint's config read here: what a child process is sent."""
        if self.checkpoint_config is not None:
            return self
        return replace(
            self,
            checkpoint_config=config_values(load_config(self.model.path, self.model.load_format)),
        )

    def build(self, tp: TPGroup | None = None, hf_config=None) -> "ModelRunner":
        return ModelRunner(self, tp or TPGroup.single(), hf_config)


def matmul_dtype(model: ModelConfig, gguf: bool) -> torch.dtype | None:
    """The dtype of the oneDNN matmuls a runner of `model` packs (`gguf`: it reads GGUF blocks);
    None: it packs none."""
    return weight_packing.choose(
        model.device,
        DTYPES[model.dtype],
        model.weight_layout,
        model.weight_format,
        gguf_blocks=True if gguf else None,
    ).matmul_dtype


class ModelRunner:
    def __init__(self, runner_spec: "RunnerSpec", tp: TPGroup, hf_config=None) -> None:
        model, cache = runner_spec.model, runner_spec.cache
        device = torch.device(model.device)
        if device.type == "cuda" and tp.rank > 0:
            # each worker selected its own GPU
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = DTYPES[model.dtype]
        self.device, self.dtype, self.block_size = device, dtype, cache.block_size
        if hf_config is None and runner_spec.checkpoint_config is not None:
            hf_config = config_from_values(runner_spec.checkpoint_config)
        self.config = hf_config or load_config(model.path, model.load_format)
        self.tp = tp
        self.weight_format = model.weight_format  # None: this dtype's own
        self.row_independent = model.row_independent
        self.gguf_blocks = gguf_blocks_for(model, self.config)
        # no kernels: fp32, the same values
        if self.weight_format in GGUF_FORMATS and self.gguf_blocks is None:
            self.weight_format = None
        if (
            self.weight_format not in (None, *GGUF_FORMATS)
            and device.type == "cpu"
            and model.row_independent
        ):
            check_supported(
                self.weight_format, "target_dtype"
            )  # a one-line error before any weight loads
        self.packing = weight_packing.choose(
            model.device,
            dtype,
            model.weight_layout,
            self.weight_format,
            model.row_independent,
            self.gguf_blocks,
            model_class_for(self.config).stacked_params,
            tied_head=bool(getattr(self.config, "tie_word_embeddings", False)),
        )
        if self.packing.matmul_dtype == torch.bfloat16 and self.weight_format is None:
            check_supported("bf16", "dtype")
        if self.packing.matmul_dtype is not None:
            row_padding.install(self.packing.matmul_dtype, dict(model.row_padding))
        self.model = build_model(
            model.path,
            self.config,
            runner_spec.max_position,
            dtype,
            device,
            self.tp,
            progress=self.tp.rank == 0,
            on_module_loaded=self.packing.pack,
            load_format=model.load_format,
            skip=self.gguf_blocks.holds if self.gguf_blocks else None,
        )  # read from the GGUF instead
        self.attention_backend = select_backend(model.attention_backend, device, cache.block_size)
        if self.row_independent and self.attention_backend is torch_attention:
            self.attention_backend = row_independent_attention
        for layer in self.model.model.layers:
            layer.self_attn.attn.backend = self.attention_backend
        self.layer_ops = layer_ops.select_layer_ops(model.fused_kernels, device, model.compile)
        self.model.use_layer_ops(self.layer_ops)
        # tensor parallelism stays eager: its all-reduces are not traced
        self.compiled = (
            CompiledModel(self.model.model) if model.compile and self.tp.size == 1 else None
        )
        self.hidden = self.compiled or self.model
        self.graphs = self._graph_runner(
            model.graph_max_batch, cache.num_kv_blocks, runner_spec.max_position
        )
        self.piecewise = self._piecewise_graphs(model.graph_max_batch)
        # + the padding rows' block
        self._allocate_kv_cache(cache.num_kv_blocks + (self.graphs is not None))
        if self.compiled is not None:
            self.compiled.warm_up(self._throwaway_step)

    def _graph_runner(self, cap: int, num_kv_blocks: int, max_position: int) -> GraphRunner | None:
        """CUDA graphs on a GPU (or emulated), not for dense-mask backends (not capturable)."""
        dense = self.attention_backend in (torch_attention, row_independent_attention)
        if cap == 0 or dense or not (self.device.type == "cuda" or emulating_cuda_graphs()):
            return None
        return GraphRunner(
            self.hidden,
            cap=cap,
            max_blocks=-(-max_position // self.block_size),
            block_size=self.block_size,
            pad_slot=num_kv_blocks * self.block_size,
            device=self.device,
            capture="cuda" if self.device.type == "cuda" else "emulate",
            recorded=self.compiled is None,
        )

    def _piecewise_graphs(self, cap: int) -> PiecewiseGraphs | None:
        """Piecewise graphs for steps whole-step graphs cannot hold; none for a compiled forward."""
        if (
            cap == 0
            or self.compiled is not None
            or not (self.device.type == "cuda" or emulating_cuda_graphs())
        ):
            return None
        return PiecewiseGraphs(
            self.model.model,
            device=self.device,
            capture="cuda" if self.device.type == "cuda" else "emulate",
        )

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The last hidden states of a prepared step: a graph replay where one holds its shape."""
        tokens = input_ids.shape[0]
        key = self.graphs and self.graphs.family_key(meta, tokens)
        if key:
            return self.graphs.run(input_ids, positions, meta, key)
        if self.piecewise is not None and self.piecewise.holds(tokens):
            return self.piecewise.run(input_ids, positions, meta)
        return self.hidden(input_ids, positions, meta)

    @torch.inference_mode()
    def _throwaway_step(self, tokens: int) -> None:
        """A forward of `tokens` tokens into the first blocks (none held yet), to compile early."""
        blocks = list(range(-(-tokens // self.block_size)))
        self.forward_hidden(*self.prepare(StepInputs([0], [[0] * tokens], [blocks], [[]])))

    @torch.inference_mode()
    def capture_graphs(self, keys: list[tuple]) -> None:
        """Graph these step shapes for every row bucket (emulation captures lazily).
        ("paged", n): n tokens per row; ("tree", K): branch steps with K-token paths."""
        if self.piecewise is not None and self.piecewise.capture == "cuda":
            self.piecewise.capture_all()
        if self.graphs is None:
            return
        if self.graphs.capture == "cuda":
            self.graphs.capture_all(keys)
        self.graphs.add_shapes(keys)

    @staticmethod
    def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        """Bytes of one KV block on the rank holding the most KV heads."""
        per_token = (
            2
            * hf_config.num_hidden_layers
            * max_kv_heads_per_rank(hf_config, tp_size)
            * head_dim(hf_config)
        )
        return per_token * block_size * torch.finfo(dtype).bits // 8

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.model.layers
        attn0 = layers[0].self_attn.attn
        shape = (2, len(layers), num_blocks * self.block_size, attn0.num_kv_heads, attn0.head_dim)
        # on CPU only the memory pages written become resident
        self.kv_cache = lazy_zeros(shape, self.dtype, self.device)
        for i, layer in enumerate(layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]

    def prepare(self, inputs: StepInputs):
        """Flat input ids and positions plus the attention metadata of one step."""
        return step_tensors(inputs, self.block_size, self.device)[:3]

    def copy_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Every layer's K and V at src_slots written to dst_slots."""
        src = torch.tensor(src_slots, dtype=torch.long, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.long, device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @property
    def local(self) -> "ModelRunner":
        """This process's own runner (a tensor-parallel runner answers its rank 0's)."""
        return self

    def release(self, seq) -> None:
        """A sequence's blocks were freed: nothing to forget here (its block table is the caller's)."""

    def close(self) -> None:
        """Nothing runs beside it: the model and its KV cache go with the object."""

    def forward(
        self, batch: ScheduledBatch, logit_rows: list[list[int]], token_ids=None, on_device=None
    ):
        """Run the batch; return fp32 logits [R, V] for the rows `logit_rows[i]` (offsets into
        sequence i's new tokens) names, in batch order."""
        return self.run(StepInputs.from_batch(batch, logit_rows, token_ids, on_device))

    @torch.inference_mode()
    def run_metadata(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Forward with attention metadata built by the caller (tree attention); logits of every row."""
        return self.model.compute_logits(self.forward_hidden(input_ids, positions, meta)).float()

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Forward one step; logits on rank 0, None on other tensor-parallel ranks."""
        input_ids, positions, meta, logit_index = step_tensors(inputs, self.block_size, self.device)
        hidden = self.forward_hidden(input_ids, positions, meta)
        if not logit_index.shape[0]:  # same on every rank: no collective is skipped unevenly
            return (
                hidden.new_zeros(0, self.config.vocab_size, dtype=torch.float32)
                if self.tp.rank == 0
                else None
            )
        logits = self.model.compute_logits(hidden[logit_index])
        return logits.float() if logits is not None else None
