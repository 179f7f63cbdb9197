"""Attention metadata for decoding every speculation-cache branch in one batch.

A branch (one predicted outcome (k, t*) of one sequence) is a path of K tokens hanging off its
sequence's trunk: the committed tokens plus the first k tokens of the speculation being verified.
At step j each branch feeds one token; it must attend to
- the trunk prefix it grows from: the first `visible[r]` slots of its sequence's trunk, and
- its own path so far: its scratch slots 0..j,
and to nothing else: never a sibling branch, never trunk positions past its fork point.
Each branch is one query row; its keys are [trunk slots (padded) | its K scratch slots], and the
mask says which of them it sees. Built with broadcasting only (no per-element Python loops).
"""
import torch

from ssd_engine.layers.attention import AttentionMetadata


def branch_mask(visible: torch.Tensor, trunk_width: int, k: int, step: int) -> torch.Tensor:
    """[R, 1, trunk_width + K] bool: trunk slots < visible[r], then path slots 0..step."""
    cols = torch.arange(trunk_width + k, device=visible.device)
    trunk = cols[None, :] < visible[:, None]
    path = (cols[None, :] >= trunk_width) & (cols[None, :] <= trunk_width + step)
    return (trunk & (cols[None, :] < trunk_width) | path).unsqueeze(1)


def branch_metadata(trunk_slots: torch.Tensor, seq_of_branch: torch.Tensor, visible: torch.Tensor,
                    scratch_slots: torch.Tensor, step: int) -> AttentionMetadata:
    """trunk_slots [S, W]: each sequence's trunk cache slots (padded); seq_of_branch [R]; visible [R]:
    trunk slots each branch sees; scratch_slots [R, K]: where each branch's path K/V lives."""
    rows, k = scratch_slots.shape
    width = trunk_slots.shape[1]
    gather = torch.cat([trunk_slots[seq_of_branch], scratch_slots], dim=1)
    mask = branch_mask(visible, width, k, step)
    return AttentionMetadata(slot_mapping=scratch_slots[:, step].contiguous(), gather_slots=gather,
                             token_to_padded=torch.arange(rows, device=gather.device), mask=mask, max_query_len=1)
