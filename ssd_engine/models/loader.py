"""Read a Hugging Face checkpoint folder: config, safetensors weights (single or sharded).

Child processes get the config as plain values (`config_values`, `config_from_values`), so they
never import transformers."""

import json
import os
from glob import glob
from types import SimpleNamespace
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from ssd_engine.models import model_class_for
from ssd_engine.utils.memory import release_freed_heap, safetensors_header
from ssd_engine.utils.progress import progress_enabled

LOAD_FORMATS = ("auto", "dummy")
DUMMY_RANGE = 1e-3  # vLLM's dummy weights: uniform(-1e-3, 1e-3)
DUMMY_SEED = 0
DUMMY_POOL = 4_000_037  # seeded draws every dummy weight is copied from (16 MB of fp32)


def check_model_dir(path: str, load_format: str = "auto") -> None:
    """`load_format="dummy"` needs config.json only: the weights are made up, not read."""
    if not os.path.isdir(path):
        raise ValueError(f"model directory not found: {path}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no config.json in model directory {path}")
    if load_format != "dummy" and not glob(os.path.join(path, "*.safetensors")):
        raise ValueError(
            f"no *.safetensors weights in model directory {path} (load_format='dummy' builds random "
            f"weights from config.json alone)"
        )


def load_config(path: str, load_format: str = "auto"):
    from transformers import AutoConfig

    check_model_dir(path, load_format)
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"sliding-window attention (use_sliding_window=true in {path}) is not supported"
        )
    model_class_for(config)  # unsupported architecture: ValueError now, not later
    return config


def config_values(config) -> dict:
    """A config read by `load_config` (or already plain) as JSON values: every attribute it holds."""
    if isinstance(config, SimpleNamespace):
        return dict(vars(config))
    return json.loads(config.to_json_string(use_diff=False))


def config_from_values(values: dict) -> SimpleNamespace:
    """The config a child builds from `config_values`' output, as plain attributes."""
    return SimpleNamespace(**values)


def build_model(
    path: str,
    config,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    tp=None,
    progress: bool = True,
    on_module_loaded: Callable[[str, nn.Module], None] | None = None,
    load_format: str = "auto",
    skip: Callable[[str], bool] | None = None,
):
    """Build the model (this rank's slice when `tp` has more than one rank) and load its weights;
    `on_module_loaded(name, module)` runs once per module as soon as all its parameters are loaded.
    `load_format="dummy"`: nothing is read (fill_dummy_weights)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    cls = model_class_for(config)
    with torch.device(device):
        model = cls(config, max_position, tp).to(dtype)
    if load_format == "dummy":
        fill_dummy_weights(model, on_module_loaded)
        return model.eval()
    load_weights(
        model,
        path,
        progress=progress and progress_enabled(),
        on_module_loaded=on_module_loaded,
        skip=skip,
    )
    return model.eval()


@torch.no_grad()
def fill_dummy_weights(
    model: nn.Module, on_module_loaded: Callable[[str, nn.Module], None] | None = None
) -> None:
    """Uniform(-1e-3, 1e-3) in every parameter, module by module (each module's hook runs as soon
    as it is filled). Normal floats (denormals run far slower), seeded: every build of a shape is
    the same model. Copied from one seeded pool, as drawing every value is slow."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(DUMMY_SEED)
    pool = torch.empty(DUMMY_POOL, device=device).uniform_(
        -DUMMY_RANGE, DUMMY_RANGE, generator=generator
    )
    pools = {torch.float32: pool}
    offset = 0
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if param.dtype not in pools:
                pools[param.dtype] = pool.to(param.dtype)
            _fill_tiled(param.data.view(-1), pools[param.dtype], offset)
            # a prime: no two parameters start alike, no row aligns with the pool
            offset += 1_000_003
        if on_module_loaded is not None:
            on_module_loaded(name, module)


def _fill_tiled(flat: torch.Tensor, pool: torch.Tensor, offset: int) -> None:
    """flat[i] = pool[(offset + i) % len(pool)]."""
    done, size = 0, pool.numel()
    while done < flat.numel():
        start = (offset + done) % size
        take = min(flat.numel() - done, size - start)
        flat[done : done + take].copy_(pool[start : start + take])
        done += take


def load_weights(
    model,
    path: str,
    window_bytes: int = 128 * 2**20,
    progress: bool = False,
    on_module_loaded: Callable[[str, nn.Module], None] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> None:
    """Copy every checkpoint tensor into the model, except what a module maps from the file.
    Pages touched through a mapping stay resident until it closes, so each file is reopened every
    `window_bytes` of copied tensors. `skip(name)`: a tensor another source provides, never read;
    its parameter counts as loaded and is never touched."""
    # names only: holding the parameters here would keep each packed layer's plain copy alive
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    loaded = set()
    finished: set[str] = set()

    def finish_ready(module_name: str) -> None:
        module = model.get_submodule(module_name)
        names = [f"{module_name}.{n}" for n, _ in module.named_parameters(recurse=False)]
        if module_name not in finished and all(_covered(n, loaded, model) for n in names):
            finished.add(module_name)
            if on_module_loaded is not None:
                on_module_loaded(module_name, module)

    files = sorted(glob(os.path.join(path, "*.safetensors")))
    headers = [safetensors_header(file)[0] for file in files]
    total = sum(_nbytes(entry) for header in headers for entry in header.values())
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
        desc=f"loading {os.path.basename(os.path.normpath(path))}",
    ) as bar:
        for file, header in zip(files, headers):
            # file order: pages read forward
            names = sorted(header, key=lambda n: header[n]["data_offsets"][0])
            while names:
                with safe_open(file, "pt", "cpu") as f:
                    taken = 0
                    while names and taken < window_bytes:
                        name = names.pop(0)
                        bar.update(_nbytes(header[name]))
                        if (
                            model.tie_word_embeddings and name == "lm_head.weight"
                        ) or "rotary_emb.inv_freq" in name:
                            continue  # tied: the embedding is the head; rotary tables are recomputed
                        module = _owner(model, params, name)
                        if skip is not None and skip(name):
                            key = _param_key(model, name)
                        elif (
                            module is not None
                            and getattr(module, "map_from", None)
                            and module.map_from(file, name)
                        ):
                            key = (name, None)
                        else:
                            tensor = f.get_tensor(name)
                            taken += _nbytes(header[name])
                            key = _load_one(model, params, name, tensor)
                            del tensor  # its pages leave RSS when the window's mapping closes
                        loaded.add(key)
                        finish_ready(key[0].rsplit(".", 1)[0])
                release_freed_heap()  # the window's packed layers freed their plain copies
    # e.g. a tied head, whose weight came with the embedding
    for (
        module_name,
        _,
    ) in model.named_modules():
        finish_ready(module_name)
    missing = [n for n in params if not _covered(n, loaded, model)]
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )


def _nbytes(entry: dict) -> int:
    begin, end = entry["data_offsets"]
    return end - begin


def _owner(model, params: set[str], name: str):
    """The module holding checkpoint tensor `name` as a whole parameter (None: fused or unknown)."""
    if name not in params:
        return None
    return model.get_submodule(name.rsplit(".", 1)[0])


def _param_key(model, name: str) -> tuple[str, str | None]:
    """(parameter, shard) an HF tensor loads into: a fused parameter's slice, or a whole parameter."""
    for hf_part, (fused, shard) in model.stacked_params.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, fused), shard
    return name, None


def _load_one(model, params: set[str], name: str, tensor: torch.Tensor) -> tuple[str, str | None]:
    """Copy one HF tensor into its parameter (or its slice of a fused one); return (param, shard)."""
    param_name, shard = _param_key(model, name)
    if param_name != name:  # a slice of a fused parameter
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
            model.get_parameter(name).copy_(tensor)
    return name, None


def _covered(param_name: str, loaded: set[tuple[str, str | None]], model) -> bool:
    """A parameter is covered when every HF tensor it is made of was loaded (each shard of a fused one)."""
    if param_name == "lm_head.weight" and model.tie_word_embeddings:
        return True
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    shards = getattr(module, "shard_offsets", None) or {None: None}
    return all((param_name, shard) in loaded for shard in shards)
