"""Owns one model and its paged KV cache: turns a scheduled batch into tensors, runs forward.

Inputs are flattened over the batch (no padding in the dense layers); attention gets compact
metadata (block tables, key counts, query offsets). A sequence computing new tokens
[start, start + n) attends to every slot up to its own position (causal over cached prefix + new
tokens). On a GPU, steps of uniform shape replay CUDA graphs (runtime/cuda_graphs.py), other steps
of up to 512 tokens piecewise ones with attention run between them (runtime/piecewise_graphs.py).

Under tensor parallelism every rank has a ModelRunner over its slice of the model and of the KV
heads; all ranks run `run()` on the same StepInputs in lockstep and only rank 0 gets logits.
"""
import os
from dataclasses import dataclass, replace

import torch

from ssd_engine.core.config_parts import CacheConfig, ModelConfig
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
from ssd_engine.layers.linear import Linear
from ssd_engine.layers.shapes import head_dim
from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE, check_supported
from ssd_engine.models import model_class_for
from ssd_engine.models.default_models import cache_dir
from ssd_engine.models.gguf_weights import GGUF_FORMATS, gguf_blocks_for, gguf_weight
from ssd_engine.models.loader import build_model, config_from_values, config_values, load_config
from ssd_engine.runtime.compiled_model import CompiledModel
from ssd_engine.runtime.cuda_graphs import GraphRunner, emulating
from ssd_engine.runtime.piecewise_graphs import PiecewiseGraphs
from ssd_engine.runtime.step_inputs import StepInputs
from ssd_engine.utils.host_upload import padded_rows, to_device, upload
from ssd_engine.utils.machine import fingerprint
from ssd_engine.utils.memory import lazy_zeros

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerSpec:
    """The one way to build a ModelRunner (target, tensor-parallel ranks, SD draft, SSD draft
    process), in plain values so other processes can build their own."""
    model: ModelConfig     # path resolved
    cache: CacheConfig     # num_kv_blocks resolved
    max_position: int      # positions the model must cover: max_model_len + K + 1 (drafting and verifying run past it)
    # model.path's config already read, as plain values (models/loader.py): set for a spec another
    # process builds from, which then never imports transformers; None: read from model.path
    checkpoint_config: dict | None = None

    def with_model(self, **changes) -> "RunnerSpec":
        """This runner spec with some ModelConfig fields changed (a draft's path, a rank's device);
        a new path drops the config read from the old one."""
        config = None if "path" in changes else self.checkpoint_config
        return replace(self, model=replace(self.model, **changes), checkpoint_config=config)

    def for_other_processes(self) -> "RunnerSpec":
        """This spec with its checkpoint's config read here: what a child process is sent."""
        if self.checkpoint_config is not None:
            return self
        return replace(self, checkpoint_config=config_values(load_config(self.model.path, self.model.load_format)))

    def build(self, tp: TPGroup | None = None, hf_config=None) -> "ModelRunner":
        """`hf_config`: replaces the checkpoint's (a few-layer copy of a model, to time it)."""
        return ModelRunner(self, tp or TPGroup.single(), hf_config)


class ModelRunner:
    def __init__(self, runner_spec: "RunnerSpec", tp: TPGroup, hf_config=None) -> None:
        """Built by `RunnerSpec.build`: the runner_spec's parts travel whole, never re-listed."""
        model, cache = runner_spec.model, runner_spec.cache
        device = torch.device(model.device)
        if device.type == "cuda" and tp.rank > 0:
            device = torch.device("cuda", torch.cuda.current_device())  # each worker selected its own GPU
        dtype = DTYPES[model.dtype]
        self.device, self.dtype, self.block_size = device, dtype, cache.block_size
        if hf_config is None and runner_spec.checkpoint_config is not None:
            hf_config = config_from_values(runner_spec.checkpoint_config)
        self.config = hf_config or load_config(model.path, model.load_format)
        self.tp = tp
        self.weight_layout = model.weight_layout
        self.weight_format = model.weight_format  # a draft's chosen format or the target's; None: this dtype's own
        self.row_independent = model.row_independent  # a target's format: one kernel for every row count
        self.gguf_blocks = gguf_blocks_for(model, self.config)  # a target kept in its GGUF blocks, else None
        if self.weight_format in GGUF_FORMATS and self.gguf_blocks is None:  # no kernels: fp32, the same values
            self.weight_format = None
        if self.weight_format not in (None, *GGUF_FORMATS) and device.type == "cpu" and model.row_independent:
            check_supported(self.weight_format, "target_dtype")  # a one-line error before any weight loads
        onednn_dtype = self._onednn_dtype()
        if onednn_dtype == torch.bfloat16 and self.weight_format is None:
            check_supported("bf16", "dtype")  # packed bf16 needs oneDNN's bf16 matmul: one line, not a load crash
        if onednn_dtype is not None:  # before any forward: whether one-row steps run faster padded
            row_padding.measure_once(onednn_dtype, fingerprint(sorted(os.sched_getaffinity(0)),
                                                               torch.get_num_threads()), str(cache_dir()))
        self.model = build_model(model.path, self.config, runner_spec.max_position, dtype, device, self.tp,
                                 progress=self.tp.rank == 0, on_module_loaded=self._pack, load_format=model.load_format,
                                 skip=self.gguf_blocks.holds if self.gguf_blocks else None)  # read from the GGUF instead
        self.attention_backend = select_backend(model.attention_backend, device, cache.block_size)  # every layer's
        if self.row_independent and self.attention_backend is torch_attention:  # a re-quantized target on CPU
            self.attention_backend = row_independent_attention
        for layer in self.model.model.layers:
            layer.self_attn.attn.backend = self.attention_backend
        self.layer_ops = layer_ops.select_layer_ops(model.fused_kernels, device, model.compile)
        self.model.use_layer_ops(self.layer_ops)
        # the forward every step runs (and CUDA graphs capture): the model's, or it compiled
        # (runtime/compiled_model.py; tensor parallelism's all-reduces are not traced)
        self.compiled = CompiledModel(self.model.model) if model.compile and self.tp.size == 1 else None
        self.hidden = self.compiled or self.model
        self.graphs = self._graph_runner(model.cuda_graph_max_batch, cache.num_kv_blocks, runner_spec.max_position)
        self.piecewise = self._piecewise_graphs(model.cuda_graph_max_batch)
        self._allocate_kv_cache(cache.num_kv_blocks + (self.graphs is not None))  # + the padding rows' block
        if self.compiled is not None:
            self.compiled.warm_up(self._throwaway_step)

    def _onednn_dtype(self) -> torch.dtype | None:
        """The dtype of the oneDNN matmuls `_pack` gives this runner; None: it packs none (int formats,
        q4k, a plain layout, a GPU). A GGUF target's dense parts are oneDNN fp32 (gguf_weight.py)."""
        if self.device.type != "cpu" or (self.weight_layout == "plain" and self.weight_format is None):
            return None
        if self.gguf_blocks is not None:
            return torch.float32
        if self.weight_format is not None:
            return ACTIVATION_DTYPE[self.weight_format] if self.weight_format in ("fp32", "bf16") else None
        return self.dtype if self.dtype in (torch.float32, torch.bfloat16) else None

    def _pack(self, name: str, module) -> None:
        """Prepare one loaded Linear's CPU layout (the loader calls this layer by layer)."""
        if not isinstance(module, Linear):
            return
        if self.gguf_blocks is not None:  # the checkpoint's own blocks replace the fp32 copy just loaded
            module.use_prepared(gguf_weight(self.gguf_blocks, name, module, model_class_for(self.config).stacked_params))
            return
        if self.device.type != "cpu":
            if self.weight_format == "bf16" and module.weight.dtype != torch.bfloat16:
                # a target's bf16 on a GPU (int formats are CPU-only): its weights rounded, in dtype
                module.weight.data.copy_(module.weight.data.to(torch.bfloat16))
            return
        if self.weight_format is not None:  # a draft or a re-quantized target: every Linear, a tied head included
            module.pack_for_cpu(keep_plain=False, fmt=self.weight_format, row_independent=self.row_independent)
            return
        native = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype)
        if self.weight_layout == "plain" or native is None:
            return
        # a tied head shares the embedding table, which must stay plain: packing it would be a
        # second copy, which only "dual" pays for
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        if name == "lm_head" and tied and self.weight_layout != "dual":
            return
        module.pack_for_cpu(keep_plain=self.weight_layout == "dual", fmt=native)

    def _graph_runner(self, cap: int, num_kv_blocks: int, max_position: int) -> GraphRunner | None:
        """CUDA graphs on a GPU with a kernel backend; SSD_ENGINE_EMULATE_CUDA_GRAPHS=1 runs their
        static-buffer path on CPU too (tests). The dense masks of torch's (and the CPU kernel's) cannot be captured."""
        dense = self.attention_backend in (torch_attention, row_independent_attention)
        if cap == 0 or dense or not (self.device.type == "cuda" or emulating()):
            return None
        return GraphRunner(self.hidden, cap=cap, max_blocks=-(-max_position // self.block_size),
                           block_size=self.block_size, pad_slot=num_kv_blocks * self.block_size, device=self.device,
                           capture="cuda" if self.device.type == "cuda" else "emulate",
                           recorded=self.compiled is None)

    def _piecewise_graphs(self, cap: int) -> PiecewiseGraphs | None:
        """Piecewise graphs (runtime/piecewise_graphs.py) where whole-step ones run, for the steps they
        cannot hold; not for a compiled forward (its one region already runs every width)."""
        if cap == 0 or self.compiled is not None or not (self.device.type == "cuda" or emulating()):
            return None
        return PiecewiseGraphs(self.model.model, device=self.device,
                               capture="cuda" if self.device.type == "cuda" else "emulate")

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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
        """A forward of `tokens` tokens into the first blocks, to compile at start-up: no sequence
        holds a block yet, and each writes its K/V before it reads them."""
        blocks = list(range(-(-tokens // self.block_size)))
        self.forward_hidden(*self.prepare(StepInputs([0], [[0] * tokens], [blocks], [[]])))

    @torch.inference_mode()
    def capture_graphs(self, keys: list[tuple]) -> None:
        """Graph these step shapes, captured now for every row bucket (the CPU emulation captures
        lazily, keeping tests fast). ("paged", n): n tokens per row; ("tree", K): branch steps
        with K-token paths. Other steps replay piecewise graphs (runtime/piecewise_graphs.py), captured
        now too, up to their largest bucket of tokens, and run eagerly past it."""
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
        per_token = 2 * hf_config.num_hidden_layers * max_kv_heads_per_rank(hf_config, tp_size) * head_dim(hf_config)
        return per_token * block_size * torch.finfo(dtype).bits // 8

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.model.layers
        attn0 = layers[0].self_attn.attn
        shape = (2, len(layers), num_blocks * self.block_size, attn0.num_kv_heads, attn0.head_dim)
        # sized for every sequence at full length; on CPU only the memory pages written become resident
        self.kv_cache = lazy_zeros(shape, self.dtype, self.device)
        for i, layer in enumerate(layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]

    def prepare(self, inputs: StepInputs):
        """Flat input ids and positions plus the attention metadata of one step."""
        return self._prepared(inputs)[:3]

    def _prepared(self, inputs: StepInputs):
        """prepare's three, and the flat index of the rows `inputs.logit_rows` names: all of it
        crosses to the device in one copy (utils/host_upload.py)."""
        bs = self.block_size
        ids, positions, slots, kv_lens, query_start, logit_index = [], [], [], [], [0], []
        for start, fed, table, rows in zip(inputs.starts, inputs.token_ids, inputs.block_tables, inputs.logit_rows):
            end = start + len(fed)
            logit_index.extend(len(ids) + r for r in rows)
            ids.extend(fed)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            kv_lens.append(end)
            query_start.append(query_start[-1] + len(fed))
        max_kv = max(kv_lens)
        blocks = -(-max_kv // bs)
        held_at, held = inputs.on_device or ([], None)
        ids_t, positions_t, slots_t, kv_lens_t, query_start_t, tables_t, held_at_t, logit_index_t = upload(
            [ids, positions, slots, kv_lens, query_start, padded_rows(inputs.block_tables, blocks), held_at,
             logit_index], self.device, torch.int32)  # int32 throughout: no casts on the device
        if held is not None:  # device-held fed tokens (drafts) written in place there: no host read
            held = held.to(self.device) if held.device.type != "cpu" else to_device(held, self.device)
            ids_t = held if held_at == list(range(len(ids))) else ids_t.index_put_((held_at_t,), held.to(torch.int32))
        meta = AttentionMetadata(
            slot_mapping=slots_t, block_tables=tables_t.view(len(kv_lens), blocks),
            kv_lens=kv_lens_t, query_start=query_start_t,
            max_query_len=max(len(fed) for fed in inputs.token_ids), max_kv_len=max_kv, block_size=bs)
        return ids_t, positions_t, meta, logit_index_t

    def copy_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Every layer's K and V at src_slots written to dst_slots (a computed path kept as is)."""
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

    def forward(self, batch: ScheduledBatch, logit_rows: list[list[int]], token_ids=None, on_device=None):
        """Run the batch; return logits [R, V] (fp32) for the rows named by `logit_rows[i]`
        (offsets into sequence i's new tokens), concatenated in batch order. `token_ids` and
        `on_device` as in `StepInputs`."""
        return self.run(StepInputs.from_batch(batch, logit_rows, token_ids, on_device))

    @torch.inference_mode()
    def run_metadata(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Forward with attention metadata built by the caller (tree attention); logits of every row."""
        return self.model.compute_logits(self.forward_hidden(input_ids, positions, meta)).float()

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Forward one step; logits on rank 0, None on other tensor-parallel ranks."""
        input_ids, positions, meta, logit_index = self._prepared(inputs)
        hidden = self.forward_hidden(input_ids, positions, meta)
        if not logit_index.shape[0]:  # every rank agrees on this (same inputs): no collective is skipped unevenly
            return hidden.new_zeros(0, self.config.vocab_size, dtype=torch.float32) if self.tp.rank == 0 else None
        logits = self.model.compute_logits(hidden[logit_index])
        return logits.float() if logits is not None else None
