"""Whether to draw progress bars: an environment variable, which spawned processes inherit."""

import os

PROGRESS_ENV = "SSD_ENGINE_PROGRESS"  # "0" hides the bars


def progress_enabled() -> bool:
    return os.environ.get(PROGRESS_ENV, "1") != "0"
