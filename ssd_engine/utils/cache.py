"""Where the engine keeps what it makes once per machine: the converted models, calibrations,
probes' results and the compiled GGUF kernels. Standard library only: a cache hit must stay cheap."""
import os
from pathlib import Path

CACHE_ENV = "SSD_ENGINE_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ssd_engine").expanduser()
