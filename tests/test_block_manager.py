"""BlockManager: block allocation, ref counts, chained-hash prefix caching, commit, trim (rollback)."""

import pytest

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.structures import Sequence
from ssd_engine.runtime.block_manager import BlockManager

BS = 4


def make_seq(tokens, block_size=BS):
    return Sequence(list(tokens), SamplingParams(max_tokens=4), block_size)


def compute_all(bm, seq):
    """Pretend the model computed every token of `seq`, then register its full blocks."""
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


def hashed(bm, block_id):
    block = bm.blocks[block_id]
    return block.hash is not None and bm.hash_to_block.get(block.hash) == block_id


# ---- plain allocation -------------------------------------------------------------------------
def test_allocate_and_deallocate_track_refcounts_and_free_list():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10, 20))  # 10 tokens -> 3 blocks
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert all(b not in bm.free for b in seq.block_table)
    assert seq.num_cached_tokens == 0 and seq.num_computed_tokens == 0

    other = make_seq(range(100, 105))  # 2 blocks, distinct from the first sequence's
    bm.allocate(other)
    assert not set(other.block_table) & set(seq.block_table)
    assert bm.num_free_blocks == 3

    table = list(seq.block_table)
    seq.num_computed_tokens = 7
    bm.deallocate(seq)
    assert len(seq.block_table) == 0 and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 6
    assert all(bm.blocks[b].ref_count == 0 and b in bm.free for b in table)
    bm.deallocate(other)
    assert bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_out_of_blocks_raises():
    bm = BlockManager(2, BS)
    big = make_seq(range(10, 19))  # 9 tokens -> 3 blocks > 2
    assert bm.blocks_needed(9) == 3
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(big)

    bm2 = BlockManager(2, BS)
    seq = make_seq(range(10, 15))  # 2 blocks: all of them
    assert bm2.can_allocate(seq)
    bm2.allocate(seq)
    assert bm2.num_free_blocks == 0
    assert not bm2.can_allocate(make_seq([7]))
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm2.grow(seq, 9)


def test_grow_and_slots_needed():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10, 15))  # 5 tokens -> 2 blocks
    bm.allocate(seq)
    assert bm.slots_needed(seq, 5) == 0
    assert bm.slots_needed(seq, 8) == 0
    assert bm.slots_needed(seq, 9) == 1
    assert bm.slots_needed(seq, 17) == 3
    assert bm.slots_needed(seq, 1) == 0  # never negative
    bm.grow(seq, 13)
    assert len(seq.block_table) == 4 and len(set(seq.block_table)) == 4
    assert bm.num_free_blocks == 4
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.grow(seq, 6)  # already big enough: no-op
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    assert len(seq) == 5  # growing adds slots, not tokens


# ---- prefix caching -----------------------------------------------------------------------------
def test_prefix_hit_shares_full_blocks():
    bm = BlockManager(16, BS)
    a = make_seq(range(10, 20))  # 10 tokens: blocks [10..13], [14..17], [18, 19]
    bm.allocate(a)
    compute_all(bm, a)
    free_before = bm.num_free_blocks

    b = make_seq(list(range(10, 18)) + [50, 51, 52])  # shares two full blocks, then differs
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert all(bm.blocks[x].ref_count == 2 for x in a.block_table[:2])
    assert bm.blocks[a.block_table[2]].ref_count == 1
    assert b.num_cached_tokens == 2 * BS
    assert b.num_computed_tokens == 2 * BS
    assert bm.num_free_blocks == free_before - 1  # only the new third block was taken

    # freeing one sharer keeps the blocks alive for the other
    bm.deallocate(a)
    assert all(bm.blocks[x].ref_count == 1 and x not in bm.free for x in b.block_table[:2])


def test_block_holding_last_prompt_token_is_never_a_hit():
    bm = BlockManager(16, BS)
    a = make_seq(range(10, 22))  # 12 tokens, 3 full blocks
    bm.allocate(a)
    compute_all(bm, a)
    assert all(hashed(bm, x) for x in a.block_table)

    same = make_seq(range(10, 22))  # identical prompt: its last block holds the last token
    bm.allocate(same)
    assert same.block_table[:2] == a.block_table[:2]
    assert same.block_table[2] != a.block_table[2]
    assert same.num_cached_tokens == 2 * BS and same.num_computed_tokens == 2 * BS

    prefix = make_seq(range(10, 18))  # exactly the first two blocks
    bm.allocate(prefix)
    assert prefix.block_table[0] == a.block_table[0]
    assert prefix.block_table[1] != a.block_table[1]
    assert prefix.num_cached_tokens == BS

    one_block = make_seq(range(10, 14))  # a single full block = the last token's block
    bm.allocate(one_block)
    assert one_block.num_cached_tokens == 0 and one_block.block_table[0] != a.block_table[0]


def test_hashes_are_chained_over_the_prefix():
    bm = BlockManager(32, BS)
    p, q, r = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    a = make_seq(p + q + [1])  # caches P@0, Q@1 (after P)
    e = make_seq(r + [5, 6, 7, 8, 9])  # caches R@0
    for s in (a, e):
        bm.allocate(s)
        compute_all(bm, s)

    # same block content at a different position: no hit
    moved = make_seq(q + [40, 41])
    bm.allocate(moved)
    assert moved.num_cached_tokens == 0 and moved.block_table[0] != a.block_table[1]

    # Q after a different (itself cached) prefix R: R hits, Q must not
    f = make_seq(r + q + [1])
    bm.allocate(f)
    assert f.block_table[0] == e.block_table[0]
    assert f.block_table[1] != a.block_table[1]
    assert f.num_cached_tokens == BS
    assert bm.blocks[a.block_table[1]].ref_count == 1

    # and the original chain still hits in full
    again = make_seq(p + q + [2])
    bm.allocate(again)
    assert again.block_table[:2] == a.block_table[:2] and again.num_cached_tokens == 2 * BS


def test_cached_block_survives_on_free_list_until_reused():
    bm = BlockManager(4, BS)
    a = make_seq(range(10, 19))  # 9 tokens -> 3 blocks, 2 of them full
    bm.allocate(a)
    compute_all(bm, a)
    cached = a.block_table[:2]
    bm.deallocate(a)  # owner finishes
    assert bm.num_free_blocks == 4
    assert all(hashed(bm, x) for x in cached)

    # the cached prefix is found again, straight from the free list
    b = make_seq(range(10, 19))
    bm.allocate(b)
    assert b.block_table[:2] == cached
    assert b.num_cached_tokens == 2 * BS
    assert all(bm.blocks[x].ref_count == 1 and x not in bm.free for x in cached)
    assert bm.num_free_blocks == 1
    bm.deallocate(b)
    old_hashes = [bm.blocks[x].hash for x in cached]

    # other content takes 3 of the 4 blocks: the oldest-freed first, the shared head last
    c = make_seq(range(100, 112))
    bm.allocate(c)
    reused = set(c.block_table) & set(cached)
    assert reused == {cached[1]}  # the second cached block was overwritten ...
    assert not hashed(bm, cached[1]) and bm.blocks[cached[1]].hash is None
    assert old_hashes[1] not in bm.hash_to_block  # ... and its hash dropped
    assert hashed(bm, cached[0])  # ... the first one survived
    bm.deallocate(c)

    d = make_seq(range(10, 19))
    bm.allocate(d)
    assert d.block_table[0] == cached[0]
    assert d.num_cached_tokens == BS  # only the surviving block hits
    bm.deallocate(d)

    # fill every block with other content: the whole prefix is evicted
    e = make_seq(range(200, 216))
    bm.allocate(e)
    assert not any(hashed(bm, x) for x in cached)
    assert all(bm.blocks[x].hash is None for x in cached)
    bm.deallocate(e)
    assert not set(old_hashes) & set(bm.hash_to_block)
    f = make_seq(range(10, 19))
    bm.allocate(f)
    assert f.num_cached_tokens == 0 and f.num_computed_tokens == 0

    # recomputed into new blocks, the prefix is registered (and hit) again
    compute_all(bm, f)
    assert all(hashed(bm, x) for x in f.block_table[:2])
    f_table = list(f.block_table)
    bm.deallocate(f)
    g = make_seq(range(10, 19))
    bm.allocate(g)
    assert list(g.block_table[:2]) == f_table[:2] and g.num_cached_tokens == 2 * BS


def test_commit_registers_only_full_computed_blocks():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10, 20))  # 10 tokens: 2 full blocks + 2 tokens
    bm.allocate(seq)
    bm.commit(seq)  # nothing computed yet
    assert bm.hash_to_block == {}

    seq.num_computed_tokens = 6  # block 0 complete, block 1 half computed
    bm.commit(seq)
    assert hashed(bm, seq.block_table[0])
    assert bm.blocks[seq.block_table[0]].token_ids == [10, 11, 12, 13]
    assert not hashed(bm, seq.block_table[1]) and bm.blocks[seq.block_table[1]].hash is None

    seq.num_computed_tokens = 10
    bm.commit(seq)
    assert hashed(bm, seq.block_table[1])
    assert bm.blocks[seq.block_table[1]].token_ids == [14, 15, 16, 17]
    assert bm.blocks[seq.block_table[2]].hash is None  # partial last block is never registered
    assert len(bm.hash_to_block) == 2

    # slots grown past the tokens (e.g. lookahead) are not registered either
    bm.grow(seq, 16)
    seq.num_computed_tokens = 16
    bm.commit(seq)
    assert len(bm.hash_to_block) == 2


class CountingList(list):
    """Counts item reads."""

    reads = 0

    def __getitem__(self, index):
        CountingList.reads += 1
        return super().__getitem__(index)


def test_commit_after_every_token_chains_as_one_commit_and_reads_only_the_blocks_it_fills():
    """Decoding commits after every step: a step costs the blocks it filled (and a look back at the last
    hashed one), not the table's length, and the hashes chain as committing the whole sequence at once."""
    tokens = list(range(10, 10 + 40 * BS + 3))
    at_once, stepped = BlockManager(64, BS), BlockManager(64, BS)
    whole = make_seq(tokens)
    at_once.allocate(whole)
    compute_all(at_once, whole)
    seq = make_seq(tokens[:5])
    stepped.allocate(seq)
    stepped.blocks = CountingList(stepped.blocks)
    CountingList.reads = 0
    for token in tokens[5:]:
        seq.token_ids.append(token)
        stepped.grow(seq, len(seq))
        seq.num_computed_tokens = len(seq) - 1
        stepped.commit(seq)
    assert CountingList.reads < 3 * len(tokens)  # every block every step: ~40 x 160 / 2
    assert [stepped.blocks[b].hash for b in seq.block_table[:40]] == [
        at_once.blocks[b].hash for b in whole.block_table[:40]
    ]
    assert len(stepped.hash_to_block) == 40


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(range(10, 20))
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.hash_to_block == {}
    b = make_seq(range(10, 20))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


# ---- rollback ------------------------------------------------------------------------------------
def test_trim_frees_blocks_reserved_past_the_sequence_and_keeps_committed_hashes():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10, 16))  # 6 tokens -> 2 blocks, 1 full
    bm.allocate(seq)
    compute_all(bm, seq)
    head = list(seq.block_table)
    bm.grow(seq, len(seq) + 1 + 5)  # a verification step's lookahead: last token + K = 5 drafts
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5

    seq.token_ids += [16, 17]  # one draft accepted, then the bonus: 8 tokens, blocks 0-1 in use
    seq.num_computed_tokens = len(seq) - 1
    reserved = seq.block_table[2]
    bm.trim(seq)
    assert list(seq.block_table) == head and bm.num_free_blocks == 6
    assert (
        bm.blocks[reserved].ref_count == 0
        and reserved in bm.free
        and bm.blocks[reserved].hash is None
    )
    assert hashed(bm, head[0])
    bm.commit(seq)
    assert not hashed(bm, head[1])  # the bonus token's K/V is computed by the next step
    compute_all(bm, seq)
    assert hashed(bm, head[1])

    # a later prompt with this prefix reuses both blocks
    probe = make_seq(range(10, 19))
    bm.allocate(probe)
    assert list(probe.block_table[:2]) == head and probe.num_cached_tokens == 2 * BS


def test_trim_keeps_exactly_the_blocks_the_tokens_need():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10, 18))  # 8 tokens: exactly 2 blocks
    bm.allocate(seq)
    bm.grow(seq, 13)
    assert len(seq.block_table) == 4
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.trim(seq)  # nothing past the tokens: no-op
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8
