"""Read a Hugging Face checkpoint folder: config, safetensors weights (single or sharded)."""
import os
from glob import glob

import torch
from safetensors import safe_open
from transformers import AutoConfig

from ssd_engine.models import model_class_for


def check_model_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"model directory not found: {path}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no config.json in model directory {path}")
    if not glob(os.path.join(path, "*.safetensors")):
        raise ValueError(f"no *.safetensors weights in model directory {path}")


def load_config(path: str):
    check_model_dir(path)
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"sliding-window attention (use_sliding_window=true in {path}) is not supported")
    model_class_for(config)  # unsupported architecture: ValueError now, not an AttributeError while sizing the KV cache
    return config


def build_model(path: str, config, max_position: int, dtype: torch.dtype, device: torch.device, tp=None):
    """Build the model (this rank's slice when `tp` has more than one rank) and load its weights."""
    cls = model_class_for(config)
    with torch.device(device):
        model = cls(config, max_position, tp).to(dtype)
    load_weights(model, path)
    return model.eval()


def load_weights(model, path: str, window_bytes: int = 512 * 2**20) -> None:
    """Copy every checkpoint tensor into the model.

    Files are mmap'd; touched pages count as resident while mapped, so each file is reopened every
    `window_bytes` of tensors to unmap what was already copied (otherwise loading a 6 GB checkpoint
    briefly holds twice its size in RSS)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for file in sorted(glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, "pt", "cpu") as f:
            names = list(f.keys())
        while names:
            with safe_open(file, "pt", "cpu") as f:
                taken = 0
                while names and taken < window_bytes:
                    name = names.pop(0)
                    if (model.tie_word_embeddings and name == "lm_head.weight") or "rotary_emb.inv_freq" in name:
                        continue  # tied: the embedding is the head; rotary tables are recomputed
                    tensor = f.get_tensor(name)
                    taken += tensor.numel() * tensor.element_size()
                    loaded.add(_load_one(model, params, name, tensor))
    missing = [n for n in params if not _covered(n, loaded, model)]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _load_one(model, params, name: str, tensor: torch.Tensor) -> tuple[str, str | None]:
    """Copy one HF tensor into its parameter (or its slice of a fused one); return (param, shard)."""
    for hf_part, (fused, shard) in model.stacked_params.items():
        if f".{hf_part}." in name:
            param_name = name.replace(hf_part, fused)
            module = model.get_submodule(param_name.rsplit(".", 1)[0])
            module.load(tensor, shard=shard, is_bias=name.endswith(".bias"))
            return param_name, shard
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    module = model.get_submodule(name.rsplit(".", 1)[0])
    with torch.no_grad():
        if hasattr(module, "load"):  # sharded layers keep only this rank's slice
            module.load(tensor, is_bias=name.endswith(".bias"))
        else:
            params[name].copy_(tensor)
    return name, None


def _covered(param_name: str, loaded: set[tuple[str, str | None]], model) -> bool:
    """A parameter is covered when every HF tensor it is made of was loaded (each shard of a fused one)."""
    if param_name == "lm_head.weight" and model.tie_word_embeddings:
        return True
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    shards = getattr(module, "shard_offsets", None) or {None: None}
    return all((param_name, shard) in loaded for shard in shards)
