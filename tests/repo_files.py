"""The repository's own files: what git tracks. A scan of the checkout must not read what a user
keeps beside the code (a .venv, caches, results, build folders), so every repo-wide test walks this."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracked_files(root: Path = REPO, under: str = "") -> list[Path]:
    """Files git tracks under `root` (a checkout), optionally only below the folder `under`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", under or "."], cwd=root, capture_output=True, check=True
    )
    names = [n for n in listed.stdout.decode().split("\0") if n]
    return sorted(
        root / n for n in names if os.path.isfile(root / n)
    )  # a deleted, not yet committed file is gone
