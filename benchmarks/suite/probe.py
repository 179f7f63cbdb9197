"""Time single forwards of one of our models: n new tokens after a fixed prefix, on the model's
own paged KV (the forward-cost tables and the contention benchmark use it)."""

import time


class ForwardProbe:
    """`probe(n)` runs one forward of n new tokens (logits for all n rows) after a `prefix`-token
    prefix and returns its seconds; the prefix's K/V is computed once."""

    def __init__(self, runner, blocks, prefix: int) -> None:
        import torch

        from ssd_engine import SamplingParams
        from ssd_engine.core.structures import ScheduledBatch, Sequence

        self.runner, self.blocks, self.prefix, self.batch_type = (
            runner,
            blocks,
            prefix,
            ScheduledBatch,
        )
        self.sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
        self.seq = Sequence(
            [3 + i % 250 for i in range(prefix)],  # ids every vocabulary has
            SamplingParams(temperature=0),
            blocks.block_size,
        )
        blocks.grow(self.seq, prefix)
        runner.forward(ScheduledBatch([self.seq], [prefix]), [[prefix - 1]])
        self.seq.num_computed_tokens = prefix

    def __call__(self, n: int) -> float:
        self.blocks.grow(self.seq, self.prefix + n)
        self.seq.token_ids = self.seq.token_ids[: self.prefix] + [42] * n
        started = time.perf_counter()
        self.runner.forward(self.batch_type([self.seq], [n]), [list(range(n))])
        self.sync()
        return time.perf_counter() - started

    def close(self) -> None:
        self.blocks.deallocate(self.seq)


def best_of(runner, blocks, prefix: int, sizes: list[int], reps: int) -> dict[int, float]:
    """Fastest of `reps` forwards per size, after one warm-up each (0 reps: nothing measured)."""
    if reps <= 0:
        return {}
    probe = ForwardProbe(runner, blocks, prefix)
    costs = {n: min([probe(n) for _ in range(reps + 1)][1:]) for n in sizes}
    probe.close()
    return costs
