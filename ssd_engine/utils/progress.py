"""Whether to draw progress bars (loading, first-run conversion).

An environment variable rather than an argument because the bars are drawn in processes the
engine spawns (the SSD draft, tensor-parallel workers, the converter), which inherit it; the CLI's
--no-progress sets it. Standard library only: default_models imports it on its cheap path.
"""
import os

PROGRESS_ENV = "SSD_ENGINE_PROGRESS"  # "0" hides the bars


def progress_enabled() -> bool:
    return os.environ.get(PROGRESS_ENV, "1") != "0"
