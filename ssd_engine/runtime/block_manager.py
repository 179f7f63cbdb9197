"""Paged KV blocks: allocation, reference counts, prefix caching with chained hashes, rollback.
A full committed block's hash chains from its predecessor's, so equal prefixes share blocks. Freed
blocks keep their hash (oldest freed reused first), so a cached prefix survives until needed."""

from collections import OrderedDict
from dataclasses import dataclass, field

from ssd_engine.core.structures import Paged, Sequence, new_block_table

NO_HASH = None


def chain_hash(prev_hash: int | None, tokens: list[int]) -> int:
    return hash((prev_hash, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = NO_HASH
    token_ids: list[int] = field(default_factory=list)  # kept to rule out hash collisions


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks where they match.
        Only blocks ending before the last token can hit: the last token must be computed for its
        logits, and writing it into a shared block would mutate another sequence's cache."""
        assert not seq.block_table
        prev_hash, hitting = None, self.enable_prefix_caching
        seq.num_cached_tokens = 0
        for index in range(seq.num_blocks):
            tokens = seq.block_tokens(index)
            full = len(tokens) == self.block_size and (index + 1) * self.block_size < len(seq)
            block_id = self._lookup(prev_hash, tokens) if hitting and full else None
            if block_id is None:
                hitting = False
                block_id = self._take_free()
            else:
                self._take_shared(block_id)
                seq.num_cached_tokens += self.block_size
            seq.block_table.append(block_id)
            prev_hash = chain_hash(prev_hash, tokens) if full else None
        seq.num_computed_tokens = seq.num_cached_tokens

    def _lookup(self, prev_hash: int | None, tokens: list[int]) -> int | None:
        block_id = self.hash_to_block.get(chain_hash(prev_hash, tokens))
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def _take_shared(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        if not self.free:
            raise RuntimeError("out of KV blocks")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = NO_HASH, [], 1
        return block_id

    def deallocate(self, seq: Paged) -> None:
        for block_id in reversed(seq.block_table):  # tail first: the shared head survives longest
            self._release(block_id)
        seq.block_table = new_block_table()
        seq.num_computed_tokens = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free[block_id] = None

    def slots_needed(self, seq: Paged, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def grow(self, seq: Paged, num_tokens: int) -> None:
        for _ in range(self.slots_needed(seq, num_tokens)):
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        """Register hashes of blocks now completely filled with computed, final tokens."""
        if not self.enable_prefix_caching:
            return
        full_blocks = min(seq.num_computed_tokens, len(seq)) // self.block_size
        # hashed blocks are a table prefix: scan back only over the blocks this step filled
        start = full_blocks
        while start > 0 and self.blocks[seq.block_table[start - 1]].hash is NO_HASH:
            start -= 1
        prev_hash = self.blocks[seq.block_table[start - 1]].hash if start else None
        for index in range(start, full_blocks):
            block = self.blocks[seq.block_table[index]]
            block.token_ids = seq.block_tokens(index)
            block.hash = chain_hash(prev_hash, block.token_ids)
            self.hash_to_block.setdefault(block.hash, block.block_id)
            prev_hash = block.hash

    def trim(self, seq: Paged) -> None:
        """Rollback after verification: free blocks past the sequence's current tokens. They hold
        only rejected tokens, which `commit` never hashed."""
        keep = self.blocks_needed(len(seq))
        for block_id in seq.block_table[keep:]:
            self._release(block_id)
        del seq.block_table[keep:]
