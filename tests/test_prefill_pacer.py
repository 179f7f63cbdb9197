"""The prefill pacer: prompt tokens a decoding step may take, from measured step times, so the
running requests' next token waits at most max_decode_stall unloaded steps."""

import pytest

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.structures import Sequence
from ssd_engine.engine.prefill_pacer import FIRST_CHUNK, HEADROOM, PrefillPacer
from ssd_engine.engine.scheduler import Scheduler
from ssd_engine.runtime.block_manager import BlockManager


def test_the_budget_fills_the_allowed_stall_with_measured_prompt_tokens():
    pacer = PrefillPacer(2.0)
    assert pacer.prompt_tokens(4, 0) == FIRST_CHUNK  # nothing measured yet
    pacer.record(4, 0, 0, 0.100)  # an unloaded step of 4 decodes: 100 ms
    assert pacer.prompt_tokens(4, 0) == FIRST_CHUNK  # a prompt token's cost still unknown
    pacer.record(4, 0, 16, 0.180)  # 16 prompt tokens added 80 ms: 5 ms a token
    assert pacer.prompt_tokens(4, 0) == int(HEADROOM * 20)  # (2 - 1) x 100 ms / 5 ms, with headroom
    assert pacer.prompt_tokens(2, 0) == FIRST_CHUNK  # another batch size: its own costs
    assert pacer.prompt_tokens(4, 2) == FIRST_CHUNK  # so is another K


def test_a_prompt_always_advances_and_nothing_decoding_is_not_paced():
    pacer = PrefillPacer(1.5)
    pacer.record(1, 0, 0, 0.010)
    pacer.record(1, 0, 8, 1.0)  # a prompt token far dearer than the allowed stall
    assert pacer.prompt_tokens(1, 0) == 1
    pacer.record(0, 0, 512, 3.0)  # a step with no decodes teaches nothing
    assert pacer.decode_s == {(1, 0): 0.010}


@pytest.mark.parametrize("stall", [1.0, 0.5, -2])
def test_a_stall_of_one_or_less_is_refused(stall):
    with pytest.raises(ValueError, match="max_decode_stall"):
        PrefillPacer(stall)


def test_the_scheduler_gives_an_arriving_prompt_the_pacers_tokens_while_others_decode():
    pacer = PrefillPacer(2.0)
    pacer.record(1, 0, 0, 0.100)
    pacer.record(1, 0, 10, 0.150)  # 5 ms a prompt token: 20 tokens fit the stall, 16 are planned
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), 16, 256, None, pacer)
    a = Sequence(list(range(10, 30)), SamplingParams(max_tokens=20), 4)
    sched.add(a)
    assert sched.schedule().num_new_tokens == [20]  # nothing decodes: the whole prompt, unpaced
    a.num_computed_tokens = 20
    a.token_ids.append(7)  # a's first token: it now decodes
    b = Sequence(list(range(50, 150)), SamplingParams(max_tokens=4), 4)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, int(HEADROOM * 20)]
