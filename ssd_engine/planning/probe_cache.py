"""The format probes' one cache: a JSON file per key in the model cache's `probes/` folder."""

import json
import os

from ssd_engine.models.default_models import cache_dir


def read_probe(key: str) -> dict | None:
    """The result stored under `key`; None where there is none or it cannot be read."""
    try:
        with open(os.path.join(cache_dir(), "probes", key + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_probe(key: str, result: dict) -> None:
    """`result` stored under `key`, replaced whole: a reader never sees half a file."""
    path = os.path.join(cache_dir(), "probes", key + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
