"""Attention metadata for decoding every speculation-cache branch in one batch. At step j a branch
(a K-token path off its sequence's trunk) attends to the first `visible[r]` trunk slots and its own
scratch slots 0..j only: never a sibling branch or trunk positions past its fork point."""

import torch

from ssd_engine.layers.attention import AttentionMetadata


def branch_metadata(
    trunk_tables: torch.Tensor,
    seq_of_branch: torch.Tensor,
    visible: torch.Tensor,
    max_visible: int,
    scratch_slots: torch.Tensor,
    step: int,
    block_size: int,
) -> AttentionMetadata:
    """trunk_tables [S, P] int32: each sequence's trunk blocks; seq_of_branch [R]; visible [R]: trunk
    keys each branch sees (max_visible: their maximum, on the host); scratch_slots [R, K]: where each
    branch's path K/V lives. Step `step` writes path slot `step` and sees path slots 0..step."""
    rows = scratch_slots.shape[0]
    return AttentionMetadata(
        slot_mapping=scratch_slots[:, step].contiguous(),
        block_tables=trunk_tables,
        kv_lens=visible.to(torch.int32),
        query_start=torch.arange(rows + 1, dtype=torch.int32, device=visible.device),
        max_query_len=1,
        max_kv_len=max_visible,
        block_size=block_size,
        table_rows=seq_of_branch.to(torch.int32),
        path_slots=scratch_slots,
        path_lens=torch.full((rows,), step + 1, dtype=torch.int32, device=visible.device),
    )
