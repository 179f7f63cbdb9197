"""Every mode runs in a process of its own: only one engine is ever in memory, its peak memory
is its own, and a crash names the mode. The processes fork from one multiprocessing fork server
that imported torch, transformers and the runners once (a fresh interpreter pays ~3 s for them per
mode); importing starts no thread pool, so each mode still sets up its own threads. Results come back through a file (they carry every
output's token ids, more than a pipe buffer holds); progress through a queue to the parent's bar."""

import multiprocessing as mp
import os
import pickle
import queue
import tempfile

from tqdm.auto import tqdm

from suite import passes


def _runner(mode: str):
    from suite import hf, ours

    return {**ours.RUNNERS, **hf.RUNNERS}[mode]


def _child(mode: str, opts, prompt_sets: dict, path: str, progress_queue) -> None:
    result = _runner(mode)(opts, prompt_sets, lambda kind, label: progress_queue.put((kind, label)))
    with open(path, "wb") as f:
        pickle.dump(result, f)


def cells_of(mode: str, opts, num_sets: int) -> int:
    """How many cells a mode measures (the progress bar's total)."""
    ks = (
        len(opts.k) if mode in ("sd", "sd-all", "ssd", "hf-assisted") else 1
    )  # auto picks its own K
    batch_sizes = 1 if mode == "hf-assisted" else len(opts.batch)
    return ks * batch_sizes * num_sets


def run_modes(modes: list[str], opts, prompt_sets: dict) -> dict[str, dict]:
    """Each mode in its own process, `opts.passes` times in alternating order (benchmarks/suite/passes.py)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "suite.ours", "suite.hf"])
    total = opts.passes * sum(cells_of(mode, opts, len(prompt_sets)) for mode in modes)
    per_pass: dict[str, list[dict]] = {mode: [] for mode in modes}
    with (
        tqdm(total=total, desc="bench", unit="cell", dynamic_ncols=True) as bar,
        tempfile.TemporaryDirectory() as tmp,
    ):
        for index in range(opts.passes):
            for mode in passes.order(modes, index):
                bar.set_postfix_str(f"{mode}: loading")
                per_pass[mode].append(
                    _run_one(
                        ctx, mode, opts, prompt_sets, os.path.join(tmp, f"{mode}-{index}.pkl"), bar
                    )
                )
    return {mode: passes.merge(results) for mode, results in per_pass.items()}


def _run_one(ctx, mode: str, opts, prompt_sets: dict, path: str, bar) -> dict:
    progress = ctx.Queue()
    proc = ctx.Process(target=_child, args=(mode, opts, prompt_sets, path, progress))
    proc.start()
    while proc.is_alive() or not progress.empty():
        try:
            kind, label = progress.get(timeout=0.5)
        except queue.Empty:
            continue
        if kind == "done":
            bar.update(1)
        bar.set_postfix_str(f"{kind} {label}")
    proc.join()
    if proc.exitcode != 0 or not os.path.exists(path):
        raise SystemExit(f"mode {mode} failed (exit code {proc.exitcode}); see the traceback above")
    with open(path, "rb") as f:
        return pickle.load(f)
