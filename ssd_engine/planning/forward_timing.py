"""One forward's seconds by rows on given cores: a few dummy layers at real shapes, scaled up."""

import contextlib
import gc
import io
import os
import tempfile
import time
from dataclasses import replace

import torch

from ssd_engine.core.config_sections import CacheConfig, ModelConfig, ParallelConfig
from ssd_engine.core.core_sets import format_core_sets
from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.structures import ScheduledBatch, Sequence, new_block_table
from ssd_engine.distributed.placement import pin, unpin
from ssd_engine.models.loader import load_config
from ssd_engine.planning.formats import DraftFormat
from ssd_engine.planning.row_padding_probe import with_row_padding
from ssd_engine.runtime import step_inputs
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.tensor_parallel.launch import _spawn as spawn_ranks
from ssd_engine.utils.memory import release_freed_heap

PREFIX = 128
BLOCK = 16
TARGET_ROWS = (1, 2, 3, 5, 9)  # AR's one row, verification of K + 1 (cost is concave in rows)
DRAFT_ROWS = (1, 5, 9, 16, 32)  # one-row drafting, the glue (K + 1), branch steps (B)
REPEATS = 5  # after two warm-ups; the fastest counts
TIMED_LAYERS = 4  # decoder layers built and timed; the rest are scaled from them
BLOCKS = -(-(PREFIX + max(DRAFT_ROWS)) // BLOCK)
RANKS_TIMEOUT_S = 60.0  # the measuring ranks' collectives (distributed_timeout_s's default)


def build_timed(model: ModelConfig, fmt: DraftFormat | None = None):
    """-> (runner, scale to the whole model): real format and shapes, TIMED_LAYERS dummy layers."""
    # eager: compiling throwaway models costs more than it changes a forward's time
    changes = {"load_format": "dummy", "compile": False} | (
        {"dtype": fmt.dtype, "weight_format": fmt.name, "row_independent": False} if fmt else {}
    )
    hf_config = load_config(model.path, "dummy")
    layers = hf_config.num_hidden_layers
    hf_config.num_hidden_layers = min(layers, TIMED_LAYERS)
    timed = with_row_padding(
        replace(model, **changes), sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    )
    runner = RunnerSpec(timed, CacheConfig(BLOCK, BLOCKS), PREFIX + max(DRAFT_ROWS) + 1).build(
        hf_config=hf_config
    )
    context = [(3 + i) % hf_config.vocab_size for i in range(PREFIX)]  # ids every vocabulary has
    runner.run(step_inputs.StepInputs([0], [context], [list(range(BLOCKS))], [[PREFIX - 1]]))
    return runner, layers / hf_config.num_hidden_layers


def time_forwards(built, rows: tuple[int, ...], cores: list[int], bar) -> dict[int, float]:
    """Seconds of a whole model's forward of n new rows (logits for every row) on `cores`: the built
    layers' time scaled to the model's layer count, plus the LM head's. The row counts are timed in
    turn, REPEATS rounds, and each keeps its fastest: a load that comes and goes on the machine meets
    every row count alike, and the fastest is the forward's cost on the idle cores."""
    runner, scale = built
    token = pin(cores, len(cores))
    try:
        inputs = {}
        for n in rows:
            fed = [42 % runner.config.vocab_size] * n
            inputs[n] = runner.prepare(
                step_inputs.StepInputs([PREFIX], [fed], [list(range(BLOCKS))], [list(range(n))])
            )
            for _ in range(2):  # warm-ups
                _forward_s(runner, *inputs[n], scale)
        times = {n: [] for n in rows}
        for _ in range(REPEATS):
            for n in rows:
                times[n].append(_forward_s(runner, *inputs[n], scale))
        bar.update(len(rows))
        return {n: min(t) for n, t in times.items()}
    finally:
        unpin(token)


def time_ranks(model: ModelConfig, ranks: list[list[int]], bar) -> dict[int, float]:
    """As time_forwards, on len(ranks) tensor-parallel ranks started as the engine starts them. Timed
    with and without logits: the difference (LM head, logits gather) counts once, the rest is scaled."""
    hf_config = load_config(model.path, "dummy")
    layers = hf_config.num_hidden_layers
    timed = min(layers, TIMED_LAYERS)
    hf_config.num_hidden_layers = timed
    if isinstance(getattr(hf_config, "layer_types", None), list):
        hf_config.layer_types = hf_config.layer_types[:timed]
    with tempfile.TemporaryDirectory(prefix="ssd-engine-costs-") as folder:
        hf_config.save_pretrained(folder)
        spec = RunnerSpec(
            replace(model, path=folder, load_format="dummy", compile=False, num_threads=None),
            CacheConfig(BLOCK, BLOCKS),
            PREFIX + max(DRAFT_ROWS) + 1,
        )
        parallel = ParallelConfig(len(ranks), format_core_sets(ranks), RANKS_TIMEOUT_S)
        # its placement line is the engine's to print
        with contextlib.redirect_stderr(io.StringIO()):
            runner = spawn_ranks(parallel, spec, ranks)
        try:
            seq = Sequence([0], SamplingParams(), BLOCK)
            seq.block_table = new_block_table(range(BLOCKS))
            context = [(3 + i) % hf_config.vocab_size for i in range(PREFIX)]
            _ranks_forward_s(runner, seq, context, [PREFIX - 1])
            seq.num_computed_tokens = PREFIX
            result = {}
            for n in TARGET_ROWS:
                fed = [42 % hf_config.vocab_size] * n
                timed_s = {}
                for rows in (list(range(n)), []):
                    times = [_ranks_forward_s(runner, seq, fed, rows) for _ in range(2 + REPEATS)][
                        2:
                    ]
                    timed_s[bool(rows)] = min(times)
                result[n] = timed_s[False] * layers / timed + max(
                    timed_s[True] - timed_s[False], 0.0
                )
                bar.update(1)
            return result
        finally:
            runner.close()


@torch.inference_mode()
def _ranks_forward_s(runner, seq: Sequence, fed: list[int], logit_rows: list[int]) -> float:
    start = time.perf_counter()
    runner.forward(ScheduledBatch([seq], [len(fed)]), [logit_rows], [fed])
    return time.perf_counter() - start


@torch.inference_mode()
def _forward_s(runner, ids, positions, meta, scale: float) -> float:
    start = time.perf_counter()
    hidden = runner.model(ids, positions, meta)
    layers_done = time.perf_counter()
    runner.model.compute_logits(hidden)
    return (layers_done - start) * scale + time.perf_counter() - layers_done


def release_memory() -> None:
    """Frees a timed runner's memory (collected, freed heap pages returned) before the next loads."""
    gc.collect()
    release_freed_heap()
