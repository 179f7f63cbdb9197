"""Pure pieces of the tensor-parallel runtime: how a model splits, where ranks run, what travels."""

import os
import random

import pytest

from ssd_engine.core.core_sets import parse_core_sets
from ssd_engine.core.structures import new_block_table
from ssd_engine.distributed.partition import (
    WEIGHT_BLOCK,
    Span,
    attention_head_shards,
    even_spans,
    intermediate_spans,
)
from ssd_engine.distributed.placement import plan_core_sets
from ssd_engine.tensor_parallel.worker import BlockTableMirror


def test_even_spans_cover_the_total_in_order():
    spans = even_spans(131, 2, "intermediate_size")
    assert spans == [Span(0, 66), Span(66, 65)]
    assert even_spans(8, 4, "x") == [Span(2 * r, 2) for r in range(4)]
    with pytest.raises(
        ValueError, match=r"cannot split vocab_size \(3\) across tensor_parallel_size=4"
    ):
        even_spans(3, 4, "vocab_size")


def test_heads_split_by_whole_kv_groups_even_when_uneven():
    # SmolLM2-135M: 9 query heads in 3 KV groups of 3 -> rank 0 takes two groups, rank 1 one
    shards = attention_head_shards(9, 3, 2)
    assert [(s.q, s.kv) for s in shards] == [(Span(0, 6), Span(0, 2)), (Span(6, 3), Span(2, 1))]
    # Qwen2.5-1.5B: 12 heads, 2 KV heads, TP=2 -> one KV group each
    assert [(s.q, s.kv) for s in attention_head_shards(12, 2, 2)] == [
        (Span(0, 6), Span(0, 1)),
        (Span(6, 6), Span(1, 1)),
    ]


def test_more_ranks_than_kv_heads_replicate_each_kv_head():
    shards = attention_head_shards(12, 2, 4)
    assert [s.kv for s in shards] == [Span(0, 1), Span(0, 1), Span(1, 1), Span(1, 1)]
    assert [s.q for s in shards] == [Span(0, 3), Span(3, 3), Span(6, 3), Span(9, 3)]
    # every query head is computed exactly once, next to its own KV head
    for s in shards:
        assert all(h // 6 == s.kv.start for h in range(s.q.start, s.q.end))


def test_unsplittable_heads_name_the_sizes():
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3.*num_key_value_heads=2, tp must be a multiple"
    ):
        attention_head_shards(8, 2, 3)  # 3 ranks over 2 KV heads: not a multiple
    with pytest.raises(
        ValueError, match=r"num_key_value_heads=1 KV heads has 3 query heads.*over 2 ranks"
    ):
        attention_head_shards(3, 1, 2)  # one group of 3 query heads cannot split over 2 ranks
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        attention_head_shards(6, 4, 2)


def test_core_sets_parse_and_validate():
    assert parse_core_sets("0-3;4-7") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_core_sets("0,2;1") == [[0, 2], [1]]
    for bad in ("0;;1", "a;1", "3-1;0"):
        with pytest.raises(ValueError, match="cpu_cores"):
            parse_core_sets(bad)
    available = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="overlap"):
        plan_core_sets(2, f"{available[0]};{available[0]}")
    with pytest.raises(ValueError, match="not available"):
        plan_core_sets(1, "4096")
    with pytest.raises(ValueError, match="gives 1 core sets for 2 ranks"):
        plan_core_sets(2, str(available[0]))
    with pytest.raises(ValueError, match=f"{len(available) + 1} ranks need"):
        plan_core_sets(len(available) + 1, None)


def test_default_placement_splits_this_process_cores_evenly():
    available = sorted(os.sched_getaffinity(0))
    sets = plan_core_sets(len(available), None)
    assert sets == [[c] for c in available]
    assert sum(plan_core_sets(1, None), []) == available


def test_block_table_deltas_carry_only_changes():
    """What rank 0 sends per sequence is (blocks kept, blocks appended); the worker's mirror follows
    grow, trim (rejected drafts), preemption (table emptied, then rebuilt) and release."""
    sender, worker = BlockTableMirror(), BlockTableMirror()
    history = [[7], [7, 3], [7, 3, 9, 4], [7, 3], [], [5, 7, 3], [5, 7, 3, 8]]
    sent = []
    for table in map(new_block_table, history):
        keep, appended = sender.delta(42, table)
        sent.append((keep, list(appended)))
        assert worker.apply(42, keep, appended) == table
    assert sent[2] == (2, [9, 4]) and sent[3] == (2, []) and sent[6] == (3, [8])
    worker.forget(42)
    sender.forget(42)
    assert sender.delta(42, new_block_table([1, 2])) == (0, new_block_table([1, 2]))


def test_block_table_deltas_follow_a_table_changed_in_place():
    """The block manager grows, trims and empties a sequence's one table object between steps: each
    delta keeps exactly the blocks the last table sent shares with the new one (so a block replaced
    at the same place is resent), and the worker ends with the same table."""
    rng = random.Random(0)
    sender, worker = BlockTableMirror(), BlockTableMirror()
    table = new_block_table()
    for _ in range(500):
        before = list(sender.tables.get(1, []))
        change = rng.choice(["grow", "trim", "empty", "same"])
        if change == "grow":
            table.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))
        elif change == "trim":
            del table[rng.randrange(len(table) + 1) :]
        elif change == "empty":
            del table[:]
        keep, appended = sender.delta(1, table)
        shared = 0
        while shared < min(len(before), len(table)) and before[shared] == table[shared]:
            shared += 1
        assert keep == shared and list(appended) == list(table[shared:])
        assert worker.apply(1, keep, appended) == table


def test_nested_pins_restore_the_state_each_replaced():
    import os

    import torch

    from ssd_engine.distributed.placement import available_cores, pin, unpin

    start, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first, last = min(start), max(start)
    outer = pin([first], 1)
    inner = pin([last], 1)  # a probe on the draft's cores, inside the engine's pin
    assert os.sched_getaffinity(0) == {last} and available_cores() == sorted(start)
    unpin(inner)
    assert os.sched_getaffinity(0) == {first}  # back on the engine's cores, not left on the probe's
    unpin(outer)
    assert os.sched_getaffinity(0) == start and torch.get_num_threads() == threads
    outer, inner = pin([first], 1), pin([last], 1)
    unpin(outer)  # out of order: the inner pin now stands on the original state
    unpin(inner)
    assert os.sched_getaffinity(0) == start and torch.get_num_threads() == threads


def test_the_mlp_splits_on_whole_weight_blocks_where_it_can():
    """Qwen2.5-1.5B's 8960 hidden units are 35 blocks of 256: 18 + 17 blocks, so a GGUF target's down_proj
    slices are whole blocks; a size that is not whole blocks splits evenly."""
    assert intermediate_spans(8960, 2) == [Span(0, 4608), Span(4608, 4352)]
    assert all(
        s.start % WEIGHT_BLOCK == 0 and s.size % WEIGHT_BLOCK == 0
        for s in intermediate_spans(8960, 4)
    )
    assert intermediate_spans(131, 2) == even_spans(131, 2, "intermediate_size")
    assert intermediate_spans(256, 2) == even_spans(
        256, 2, "intermediate_size"
    )  # fewer blocks than ranks
