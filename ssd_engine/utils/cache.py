"""Where the engine keeps what it makes once per machine. Standard library only: hits stay cheap."""

import os
from pathlib import Path

CACHE_ENV = "SSD_ENGINE_CACHE"
# compiled kernels depend on the CPU and the sources only, so separate model caches may share them
KERNEL_CACHE_ENV = "SSD_ENGINE_KERNEL_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ssd_engine").expanduser()


def kernel_cache_dir() -> Path:
    return Path(os.environ.get(KERNEL_CACHE_ENV) or cache_dir() / "kernels").expanduser()
