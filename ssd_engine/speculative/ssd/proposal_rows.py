"""The draft's q rows of one SSD round as the verifier's dense [n, K, vocab] proposal on the
target's device: only whole rows cross densely; a support is scattered into it there."""

import torch

from ssd_engine.speculative.ssd.protocol import SupportRows
from ssd_engine.utils.host_upload import to_device

QRows = torch.Tensor | SupportRows | None


def proposal_probs(
    qs: list[QRows], k: int, vocab: int, device: torch.device
) -> torch.Tensor | None:
    """[n, K, vocab] float32 on `device`, row i from qs[i] (zeros where None: verified as one-hot);
    None when no row carries q. Ids past the draft's vocabulary have probability 0."""
    full = [i for i, q in enumerate(qs) if isinstance(q, torch.Tensor)]
    support = [i for i, q in enumerate(qs) if isinstance(q, SupportRows)]
    if not full and not support:
        return None
    probs = torch.zeros(len(qs), k, vocab, device=device)
    if full:
        _copy_full(probs, full, [qs[i] for i in full])
    if support:
        _scatter_supports(probs, support, [qs[i] for i in support])
    return probs


def _copy_full(probs: torch.Tensor, rows: list[int], qs: list[torch.Tensor]) -> None:
    width = qs[0].shape[-1]
    if all(q.device == probs.device for q in qs):
        for i, q in zip(rows, qs):
            probs[i, :, :width] = q
        return
    # host rows staged in pinned memory so the copy up is non-blocking
    staged = torch.empty(len(rows), *qs[0].shape, pin_memory=True)
    for j, q in enumerate(qs):
        staged[j] = q
    probs[to_device(torch.tensor(rows), probs.device), :, :width] = staged.to(
        probs.device, non_blocking=True
    )


def _scatter_supports(probs: torch.Tensor, rows: list[int], qs: list[SupportRows]) -> None:
    """One accumulate-scatter for all. Supports are padded with id 0 at probability 0: accumulating
    keeps a padding id 0 from overwriting a real one, and adding zeros keeps every bit as sent."""
    width = max(q.ids.shape[1] for q in qs)
    k = probs.shape[1]
    ids = torch.zeros(len(rows), k, width, dtype=torch.int64)
    values = torch.zeros(len(rows), k, width)
    for j, q in enumerate(qs):
        ids[j, :, : q.ids.shape[1]] = q.ids
        values[j, :, : q.ids.shape[1]] = q.probs
    device = probs.device
    at_row = to_device(torch.tensor(rows).view(-1, 1, 1), device)
    at_position = torch.arange(k, device=device).view(1, -1, 1)
    probs.index_put_(
        (at_row, at_position, to_device(ids, device)), to_device(values, device), accumulate=True
    )
