"""Run code under a `PlacementChecker` (tests/instrumentation/placement.py) the way a GPU would run it.

On CPU four branches a GPU never takes hold host memory where a GPU's is on the device: the KV cache
is an anonymous mapping (`memory.lazy_zeros`), the embedding is mapped from the checkpoint file
(`VocabParallelEmbedding.map_from`), tensor-parallel ranks all-reduce through shared memory
(`ShmCollectives`), and a draft may run in a CPU-only weight format (int8 / int4 / q4k, layers/weight_formats.py).
`gpu_placement()` takes the GPU's branch of the first two (a device allocation, a copy into the
parameter) and counts the memory of the last two as the device's where it stands for device memory (the other ranks, in processes of
their own, keep the shared-memory protocol; a GPU's draft is bf16, with its weights on the device).
It checks the SSD draft thread too (a torch mode holds in the thread that entered it).
"""

from contextlib import contextmanager

import pytest
import torch
from instrumentation.placement import Place, PlacementChecker


@contextmanager
def gpu_placement():
    import ssd_engine.runtime.model_runner as model_runner
    from ssd_engine.distributed.shm_collectives import ShmCollectives
    from ssd_engine.layers.embedding import VocabParallelEmbedding
    from ssd_engine.layers.q4k_weight import Q4KWeight
    from ssd_engine.layers.weight_formats import Int4Weight, Int8Weight
    from ssd_engine.speculative.ssd.draft_thread import DraftThread

    checker = PlacementChecker()
    run_draft, exchange = DraftThread._run, ShmCollectives._exchange

    def run_draft_checked(self, spec):
        with checker:
            run_draft(self, spec)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            model_runner,
            "lazy_zeros",
            lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device),
        )
        patch.setattr(VocabParallelEmbedding, "map_from", lambda self, path, name: False)
        patch.setattr(
            ShmCollectives,
            "_exchange",
            lambda self, tensor: _on_device(checker, exchange(self, tensor)),
        )
        for int_format in (Int8Weight, Int4Weight, Q4KWeight):
            patch.setattr(int_format, "__init__", _weights_on_device(checker, int_format.__init__))
        patch.setattr(DraftThread, "_run", run_draft_checked)
        with checker:
            yield checker


def _on_device(checker: PlacementChecker, slots: torch.Tensor) -> torch.Tensor:
    checker.assume_on_device(slots)
    return slots


def _weights_on_device(checker: PlacementChecker, init):
    def on_device_init(self, weight: torch.Tensor, *options) -> None:
        init(self, weight, *options)
        # a model's weight; the format probe's stay on the host
        if checker.place(weight) is Place.DEVICE:
            checker.assume_on_device(
                [v for v in vars(self).values() if isinstance(v, torch.Tensor)]
            )

    return on_device_init
