"""Where a speculation came from, which is also the name of the backup a round's misses take."""

import enum


class Source(enum.IntEnum):
    NONE = 0  # no speculation: the draft ran out of blocks (the sequence takes a plain target step)
    HIT = 1  # the speculation cache built while the target verified the previous round
    JIT = 2  # a miss, drafted just in time by the primary draft model
    FAST = 3  # a miss, n-gram (else random) tokens from the draft process's fast backup
    LOCAL = 4  # the coordinator's own n-gram speculator, once the draft process has failed

    @property
    def label(self) -> str:
        return self.name.lower()
