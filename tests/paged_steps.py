"""Attention metadata of paged steps for the backend tests: row b's last q_lens[b] of its kv_lens[b] keys
are its queries, its keys in the pages its block-table row names."""

import torch

from ssd_engine.layers.attention import AttentionMetadata


def paged_metadata(
    tables: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    page: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Built on the host, used on `device` (a GPU's kernels take no host pointer)."""
    slots = [
        int(tables[b, p // page]) * page + p % page
        for b in range(len(kv_lens))
        for p in range(kv_lens[b] - q_lens[b], kv_lens[b])
    ]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    return AttentionMetadata(
        torch.tensor(slots).to(device),
        tables.to(device, torch.int32),
        torch.tensor(kv_lens, dtype=torch.int32).to(device),
        starts.to(device, torch.int32),
        max(q_lens),
        max(kv_lens),
        page,
    )


def random_paged_step(
    q_lens: list[int],
    kv_lens: list[int],
    page: int,
    g: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, int]:
    """The rows' pages drawn at random (two spare pages among them); -> (metadata, cache slots needed)."""
    rows, blocks_each = len(kv_lens), max(-(-n // page) for n in kv_lens)
    tables = torch.randperm(rows * blocks_each + 2, generator=g)[: rows * blocks_each].view(
        rows, blocks_each
    )
    return paged_metadata(tables, q_lens, kv_lens, page, device), (rows * blocks_each + 2) * page
