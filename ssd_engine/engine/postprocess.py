"""A step's results applied to its sequences: tokens appended, stops checked, finished ones released."""

import time

from ssd_engine.core.structures import Outcome, ScheduledBatch, Sequence
from ssd_engine.sampling.verifier import StepResult


def apply_results(
    engine, batch: ScheduledBatch, speculated: list[bool], results: list[StepResult]
) -> list[Sequence]:
    """Each sequence of `batch` after its result (tokens emitted, drafts accepted) in LLMEngine
    `engine`: its computed tokens, the scheduler's pages, the acceptance metrics and the speculator
    told; -> the sequences it finished."""
    finished = []
    for seq, n, was_speculated, result in zip(
        batch.seqs, batch.num_new_tokens, speculated, results
    ):
        engine.stats["decode_tokens" if n == 1 or was_speculated else "prefill_tokens"] += n
        if result.tokens is None:  # a prefill chunk that does not reach the end of the prompt
            seq.num_computed_tokens += n
            continue
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.perf_counter()
        engine.output_processor.append(seq, result.tokens, result.logprobs)
        # every emitted token but the last has its K/V computed; rejected drafts' slots are dropped
        seq.num_computed_tokens = len(seq) - 1
        engine.scheduler.settle(seq, was_speculated)
        if was_speculated:
            if result.accepted is not None:
                engine.spec_metrics.record(seq.seq_id, result.accepted)
            engine.speculator.on_outcome(Outcome(seq, result.accepted, seq.num_computed_tokens))
        if seq.finish_reason is not None:
            seq.metrics.finish_time = time.perf_counter()
            engine.scheduler.finish(seq)
            finished.append(seq)
    return finished
