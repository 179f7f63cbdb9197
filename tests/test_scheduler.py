"""Scheduler: admission limits, chunked prefill, decode-first, FCFS, preemption by recompute.

No model: each "step" schedules a batch, advances every scheduled sequence's
num_computed_tokens by its num_new_tokens and, when a sequence's computed tokens reach its end
(the step that would sample), appends one token and finishes it at max_tokens.
"""

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.structures import Sequence, SequenceStatus
from ssd_engine.engine.scheduler import Scheduler
from ssd_engine.runtime.block_manager import BlockManager

BS = 4
NEXT_TOKEN = 7


def make_seq(num_prompt_tokens, max_tokens=4, start=10):
    return Sequence(
        list(range(start, start + num_prompt_tokens)), SamplingParams(max_tokens=max_tokens), BS
    )


def make_scheduler(
    num_blocks=64,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    prefix_caching=False,
    prefill_tokens_while_decoding=None,
):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, prefill_tokens_while_decoding)


def check_batch(sched, batch):
    """Invariants every batch must satisfy."""
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert len(set(id(s) for s in batch.seqs)) == len(batch.seqs)
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        assert n >= 1
        assert seq.status == SequenceStatus.RUNNING and seq in sched.running
        assert (
            len(seq.block_table) * BS >= seq.num_computed_tokens + n
        )  # slots exist for the new tokens
    for seq in sched.waiting:
        assert len(seq.block_table) == 0 and seq.status == SequenceStatus.WAITING


def step(sched, k=0):
    batch = sched.schedule(k)
    check_batch(sched, batch)
    finished = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        assert seq.num_computed_tokens <= len(seq)
        if seq.num_computed_tokens == len(seq):  # this step samples a token
            seq.token_ids.append(NEXT_TOKEN)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
                finished.append(seq)
    return batch, finished


def run_to_completion(sched, max_steps=1000):
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return batches
        batch, _ = step(sched)
        assert batch.seqs, "scheduler made no progress"
        batches.append(batch)
    raise AssertionError("did not finish")


# ---- admission limits ---------------------------------------------------------------------------
def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3, max_tokens=2, start=10 + 10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch, _ = step(sched)
    assert batch.seqs == seqs[:2]
    assert sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    batch, finished = step(sched)  # both decode once and finish (max_tokens=2)
    assert batch.seqs == seqs[:2] and finished == seqs[:2]
    batch, _ = step(sched)
    assert batch.seqs == seqs[2:]  # the freed slots go to the next two
    batches = run_to_completion(sched)
    assert all(len(b.seqs) <= 2 for b in batches)
    assert all(s.is_finished and s.num_output_tokens == 2 for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(20, max_tokens=3)
    sched.add(seq)
    sizes = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        assert batch.num_tokens <= 8
        sizes.append(batch.num_new_tokens)
    assert sizes == [[8], [8], [4], [1], [1]]  # 20-token prompt in 3 chunks, then 2 decodes
    assert seq.output_token_ids == [NEXT_TOKEN] * 3


def test_waiting_prefill_fills_leftover_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_seq(5, start=10), make_seq(5, start=50)
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [5, 3]  # b's prefill is chunked
    batch, _ = step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 2]  # decode + rest of b's prefill
    assert b.num_output_tokens == 1


def test_a_prompt_read_beside_decodes_takes_at_most_its_share_a_step():
    """prefill_tokens_while_decoding=3: while a decodes, b's 10-token prompt comes 3 tokens a step
    (running decodes wait for no more than that); alone, a prompt takes the whole budget."""
    sched = make_scheduler(max_num_batched_tokens=64, prefill_tokens_while_decoding=3)
    a = make_seq(20, max_tokens=20)
    sched.add(a)
    batch, _ = step(sched)
    assert batch.num_new_tokens == [20]  # nothing decodes yet: the whole prompt
    b, c = make_seq(10, start=50), make_seq(2, start=90)
    sched.add(b)
    sched.add(c)
    chunks = []
    while b.num_output_tokens == 0:
        batch, _ = step(sched)
        assert batch.seqs[0] is a and batch.num_new_tokens[0] == 1  # a's decode every step
        chunks.append(sum(n for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq is not a))
    assert chunks == [3, 3, 3, 3]  # b: 3 + 3 + 3 + 1, then c's first 2 tokens beside b's last
    assert c.num_computed_tokens == 2


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=1)
    a = make_seq(1, max_tokens=3)
    sched.add(a)
    step(sched)
    assert a.num_output_tokens == 1  # a is now decoding
    b = make_seq(6, start=50)
    sched.add(b)
    for expected_out in (2, 3):
        batch, _ = step(sched)
        assert batch.seqs == [a] and batch.num_new_tokens == [1]  # the budget goes to the decode
        assert list(sched.waiting) == [b] and b.num_computed_tokens == 0
        assert a.num_output_tokens == expected_out
    assert a.is_finished
    batch, _ = step(sched)
    assert batch.seqs == [b]

    # with room for both, the decode still comes first in the batch
    sched = make_scheduler(max_num_batched_tokens=64)
    a = make_seq(4, max_tokens=5)
    sched.add(a)
    step(sched)
    b = make_seq(6, start=50)
    sched.add(b)
    batch, _ = step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 6]


def test_fcfs_requests_start_in_arrival_order():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=6)
    seqs = [
        make_seq(n, max_tokens=m, start=10 + 20 * i)
        for i, (n, m) in enumerate([(9, 2), (2, 5), (7, 1), (1, 3), (5, 2)])
    ]
    for s in seqs:
        sched.add(s)
    first_seen = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        first_seen += [s for s in batch.seqs if s not in first_seen]
    assert first_seen == seqs
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)


def test_head_of_queue_is_not_overtaken_when_it_does_not_fit():
    sched = make_scheduler(num_blocks=6)
    a = make_seq(16, max_tokens=2)  # 4 blocks
    big = make_seq(10, start=50)  # 3 blocks: does not fit in the 2 left
    small = make_seq(2, start=80)  # 1 block: would fit, but arrived later
    sched.add(a)
    sched.add(big)
    sched.add(small)
    batch, _ = step(sched)
    assert batch.seqs == [a]
    assert list(sched.waiting) == [big, small]
    batch, finished = step(sched)
    assert finished == [a] and batch.seqs == [a]
    batch, _ = step(sched)
    assert batch.seqs == [big, small]


# ---- preemption ----------------------------------------------------------------------------------
def test_preemption_takes_newest_puts_it_in_front_and_recomputes():
    sched = make_scheduler(num_blocks=2, max_num_seqs=2)
    a = make_seq(4, max_tokens=2, start=10)  # after its first token it needs a second block
    b = make_seq(3, max_tokens=2, start=50)
    c = make_seq(1, max_tokens=1, start=90)  # arrives while the two slots are full
    for s in (a, b, c):
        sched.add(s)
    batch, _ = step(sched)
    assert batch.seqs == [a, b] and sched.block_manager.num_free_blocks == 0
    assert len(a) == 5 and len(b) == 4
    b_tokens = list(b.token_ids)

    batch, _ = step(sched)  # a needs a block: b (the newest) is preempted
    assert sched.num_preemptions == 1
    assert batch.seqs == [a]
    assert b not in sched.running and b.status == SequenceStatus.WAITING
    assert list(sched.waiting) == [b, c]  # back at the FRONT of the queue, ahead of c
    assert len(b.block_table) == 0 and b.num_computed_tokens == 0
    assert b.token_ids == b_tokens  # its generated token is kept, to be recomputed
    assert a.num_output_tokens == 2 and a.is_finished  # a got its block and finished

    batch, _ = step(sched)  # b is recomputed from scratch, prompt + its generated token
    assert batch.seqs[0] is b and batch.num_new_tokens[0] == len(b_tokens) == 4
    run_to_completion(sched)
    assert b.is_finished and b.output_token_ids == [NEXT_TOKEN] * 2
    assert c.is_finished
    assert sched.block_manager.num_free_blocks == 2


def test_sequence_never_preempts_an_older_one():
    sched = make_scheduler(num_blocks=2)
    a = make_seq(3, max_tokens=3, start=10)
    b = make_seq(4, max_tokens=3, start=50)  # b crosses a block boundary first
    sched.add(a)
    sched.add(b)
    step(sched)
    a_table = list(a.block_table)
    batch, _ = step(sched)  # b needs a block, none free: b preempts itself, not a
    assert sched.num_preemptions == 1
    assert batch.seqs == [a]
    assert list(a.block_table) == a_table and a.status == SequenceStatus.RUNNING
    assert list(sched.waiting) == [b] and len(b.block_table) == 0
    run_to_completion(sched)
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3


def test_preemption_of_several_keeps_their_order():
    sched = make_scheduler(num_blocks=3)
    a, b, c = (make_seq(3, max_tokens=8, start=s) for s in (10, 50, 90))
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    batch = sched.schedule(k=8)  # a's decode needs 3 + 9 = 12 slots: 2 more blocks
    assert batch.seqs == [a] and batch.num_new_tokens == [9]
    assert len(a.block_table) == 3
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    assert sched.num_preemptions == 2


def test_draft_slots_grow_blocks_for_decodes_only():
    sched = make_scheduler(num_blocks=8)
    a = make_seq(3, max_tokens=8)
    sched.add(a)
    batch = sched.schedule(k=3)
    assert batch.num_new_tokens == [3]  # a prefill gets no draft slots
    assert len(a.block_table) == 1
    a.num_computed_tokens += 3
    a.token_ids.append(NEXT_TOKEN)
    batch = sched.schedule(k=3)
    assert batch.num_new_tokens == [4]  # 1 decode + 3 draft slots
    assert len(a.block_table) == 2  # computed 3 + 4 = 7 slots -> 2 blocks
    assert sched.block_manager.num_free_blocks == 6


def test_mixed_workload_with_preemption_finishes_without_leaks():
    sched = make_scheduler(num_blocks=10, max_num_seqs=4, max_num_batched_tokens=12)
    specs = [(10, 6), (3, 9), (7, 4), (13, 3), (2, 12), (5, 5), (9, 7), (1, 1)]
    seqs = [make_seq(n, max_tokens=m, start=10 + 30 * i) for i, (n, m) in enumerate(specs)]
    for s in seqs:
        assert sched.block_manager.blocks_needed(len(s) + s.params.max_tokens) <= 10
        sched.add(s)
    first_seen = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        assert batch.seqs
        first_seen += [s for s in batch.seqs if s not in first_seen]
    assert sched.num_preemptions > 0  # the workload is tight enough to preempt
    assert first_seen == seqs
    for s, (n, m) in zip(seqs, specs):
        assert s.is_finished and s.token_ids[:n] == list(range(s.token_ids[0], s.token_ids[0] + n))
        assert s.num_output_tokens == m
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
