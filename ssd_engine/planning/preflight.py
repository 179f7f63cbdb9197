"""Checks that need no weights: run before anything loads or any process starts, so a typo in a
path costs no loading time and leaves nothing to shut down."""
import os

from ssd_engine.core.config import EngineConfig
from ssd_engine.models.loader import load_config


def check_before_loading(config: EngineConfig) -> None:
    """Raise ValueError for a model folder that cannot load (missing, no config.json, no weights
    unless load_format is dummy, unsupported architecture) or a missing calibration_dir. The built-in default pair (None) is
    resolved later: resolving it may mean converting it."""
    folders = [config.model] + ([config.draft_model] if config.speculative_mode != "ar" else [])
    for path in folders:
        if path is not None:
            load_config(path, config.load_format)
    if config.speculative_mode in ("ssd", "auto") and config.calibration_dir is not None \
            and not os.path.isdir(config.calibration_dir):
        raise ValueError(f"calibration_dir not found: {config.calibration_dir}")
