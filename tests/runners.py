"""A ModelRunner for a test, built the engine's one way (RunnerSpec.build) from a few named sizes."""

import torch

from ssd_engine.core.config_sections import CacheConfig, ModelConfig
from ssd_engine.distributed.comm import TPGroup
from ssd_engine.runtime.model_runner import DTYPES, ModelRunner, RunnerSpec

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def runner_spec(
    path: str,
    *,
    num_kv_blocks: int,
    block_size: int,
    max_position: int,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    weight_layout: str = "plain",
    **model_fields,
) -> RunnerSpec:
    """`model_fields`: any other ModelConfig field (attention_backend, graph_max_batch, compile, ...)."""
    model = ModelConfig(
        path,
        dtype=DTYPE_NAMES[dtype],
        device=str(device),
        weight_layout=weight_layout,
        **model_fields,
    )
    return RunnerSpec(model, CacheConfig(block_size, num_kv_blocks), max_position)


def tiny_runner(path: str, hf_config=None, tp: TPGroup | None = None, **sizes) -> ModelRunner:
    """`hf_config`: a config to build instead of the checkpoint's."""
    return runner_spec(path, **sizes).build(tp, hf_config)
