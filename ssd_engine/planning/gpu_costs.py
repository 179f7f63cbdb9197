"""planning/costs.py's curves on CUDA GPUs, each forward timed as the engine runs it.

Two GPUs share no memory bus, so no contention is modelled: SSD's target costs what AR's does.
A tensor-parallel target is not timed here (NotMeasured)."""

import time
from dataclasses import replace

import torch
from tqdm import tqdm

from ssd_engine.core.config_sections import ModelConfig
from ssd_engine.models.loader import load_config
from ssd_engine.planning import costs, formats
from ssd_engine.planning.forward_timing import (
    BLOCKS,
    DRAFT_ROWS,
    PREFIX,
    TARGET_ROWS,
    build_timed,
    release_memory,
)
from ssd_engine.runtime import step_inputs
from ssd_engine.utils.progress import progress_enabled

REPEATS = 15  # after three warm-ups; the median counts


def measure(
    key: str, target: ModelConfig, draft: ModelConfig, draft_dtype: str, placement: costs.Placement
) -> costs.MeasuredCosts:
    if len(placement.ranks) > 1:
        raise costs.NotMeasured(
            f"planning/gpu_costs.py times one GPU's target; {len(placement.ranks)} "
            f"tensor-parallel ranks are not timed"
        )
    started = time.perf_counter()
    gpu = placement.ranks[0][0]
    fmt = formats.resolve_draft(draft_dtype, load_config(draft.path, "dummy"), "cuda", [], None, 1)
    draft = replace(draft, dtype=fmt.dtype, weight_format=None, row_independent=False)
    steps = len(TARGET_ROWS) + 1 + (len(DRAFT_ROWS) if placement.ssd_draft else 0)
    with tqdm(
        total=steps, desc="calibrating modes (once per GPU)", disable=not progress_enabled()
    ) as bar:
        target_all = _time(target, f"cuda:{gpu}", TARGET_ROWS, bar)
        draft_all = _time(draft, f"cuda:{gpu}", (1,), bar)
        draft_one = (
            _time(draft, f"cuda:{placement.ssd_draft[0]}", DRAFT_ROWS, bar)
            if placement.ssd_draft
            else draft_all
        )
    return costs.MeasuredCosts(
        key,
        [gpu],
        list(placement.ssd_draft),
        target_all,
        target_all,
        draft_all,
        {fmt.name: draft_one},
        fmt.name,
        fmt.name,
        time.perf_counter() - started,
    )


def _time(model: ModelConfig, device: str, rows: tuple[int, ...], bar) -> dict[int, float]:
    """Median seconds of a forward of n new rows (logits for each) on `device`, per n in `rows`."""
    graphed = model.graph_max_batch > 0
    one_row_bucket = replace(model, device=device, graph_max_batch=min(model.graph_max_batch, 1))
    runner, scale = build_timed(one_row_bucket)
    try:
        if graphed:
            runner.capture_graphs([("paged", n) for n in rows])
        result = {}
        for n in rows:
            fed = [42 % runner.config.vocab_size] * n
            inputs = step_inputs.StepInputs(
                [PREFIX], [fed], [list(range(BLOCKS))], [list(range(n))]
            )
            prepared = runner.prepare(inputs)
            times = [_forward_s(runner, *prepared, scale, device) for _ in range(3 + REPEATS)][3:]
            result[n] = sorted(times)[REPEATS // 2]
            bar.update(1)
        return result
    finally:
        del runner
        release_memory()
        torch.cuda.empty_cache()


@torch.inference_mode()
def _forward_s(runner, ids, positions, meta, scale: float, device: str) -> float:
    """One forward as the engine runs it, layers' time scaled to the whole model + the head's."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    hidden = runner.forward_hidden(ids, positions, meta)
    torch.cuda.synchronize(device)
    layers_done = time.perf_counter()
    runner.model.compute_logits(hidden)
    torch.cuda.synchronize(device)
    return (layers_done - start) * scale + time.perf_counter() - layers_done
