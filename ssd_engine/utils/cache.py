"""Where the engine keeps what it makes once per machine: the converted models, calibrations,
probes' results and the compiled GGUF kernels. Standard library only: a cache hit must stay cheap."""
import os
from pathlib import Path

CACHE_ENV = "SSD_ENGINE_CACHE"
# compiled kernels depend on the CPU and the sources only (their names say which), not on the models, so a
# separate cache of models (a test's, a user's second cache) may still share them
KERNEL_CACHE_ENV = "SSD_ENGINE_KERNEL_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ssd_engine").expanduser()



def kernel_cache_dir() -> Path:
    return Path(os.environ.get(KERNEL_CACHE_ENV) or cache_dir() / "kernels").expanduser()
