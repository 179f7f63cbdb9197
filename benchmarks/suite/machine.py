"""What a result was measured on, written next to every number."""

import os
import platform
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_line() -> str:
    """The CPU model and the flags that decide which kernels and draft formats are fast (from
    ssd_engine.utils.machine, the same reading the engine's cached probes are keyed by)."""
    from ssd_engine.utils.machine import cpu_flags, cpu_model

    flags = cpu_flags()
    return f"{cpu_model()} ({', '.join(flags) if flags else 'no AVX2 / AVX-512 / AMX'})"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        return f"{count} x {torch.cuda.get_device_name(0)}" if count else "cuda (no GPU visible)"
    return f"{cpu_line()}, {os.cpu_count()} cores visible"


def git_commit() -> str:
    """HEAD of the checkout the benchmark runs from, `+dirty` when tracked files differ."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", REPO, *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def machine_line(device: str = "cpu") -> str:
    import torch

    return (
        f"{device_name(device)}; torch {torch.__version__}; python {platform.python_version()}; "
        f"commit {git_commit()}"
    )
