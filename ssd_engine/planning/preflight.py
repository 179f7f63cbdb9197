"""Checks that need no weights, run before anything loads or any process starts."""

import os
import re

from ssd_engine.core.config import EngineConfig
from ssd_engine.models.default_models import is_complete
from ssd_engine.models.gguf_files import gguf_cache_folder, is_gguf_file
from ssd_engine.models.gguf_stream import check_gguf
from ssd_engine.models.loader import load_config

# `org/name` (one slash, no leading . / ~): what a Hugging Face Hub id looks like
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WHAT_TO_PASS = "a local folder with config.json and *.safetensors, or a .gguf file"


def check_model_source(path: str, option: str = "model", load_format: str = "auto") -> None:
    """Raise a one-line ValueError unless `path` is a model folder that can load or a GGUF file the
    engine can convert. `option` names the setting in the message (model, draft_model)."""
    if os.path.isdir(path):
        load_config(path, load_format)
    elif is_gguf_file(path):
        if not is_complete(gguf_cache_folder(path)):
            check_gguf(path)  # header parsing is slow: worth it only before a conversion
    elif os.path.isfile(path):
        raise ValueError(
            f"{option} {path} is a file but not a GGUF file (no GGUF magic bytes): pass {WHAT_TO_PASS}"
        )
    elif (
        HUB_ID.match(path)
        and not path.lower().endswith(".gguf")
        and not os.path.isdir(os.path.dirname(path))
    ):
        raise ValueError(
            f"{option} {path!r} looks like a Hugging Face Hub id, but weights cannot be downloaded "
            f"here: pass {WHAT_TO_PASS}"
        )
    else:
        raise ValueError(f"{option} not found: {path} (pass {WHAT_TO_PASS})")


def check_before_loading(config: EngineConfig) -> None:
    """ValueError for a model source check_model_source refuses or a missing calibration_dir."""
    speculative, ssd = config.speculative, config.speculative.ssd
    sources = [("model", config.model.path)] + (
        [("draft_model", speculative.draft_model)] if speculative.mode != "ar" else []
    )
    for option, path in sources:
        if path is not None:
            check_model_source(path, option, config.model.load_format)
    if (
        speculative.mode in ("ssd", "auto")
        and ssd.calibration_dir is not None
        and not os.path.isdir(ssd.calibration_dir)
    ):
        raise ValueError(f"calibration_dir not found: {ssd.calibration_dir}")
