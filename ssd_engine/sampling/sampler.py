"""Seeded sampling from final probability rows.

Method: inverse CDF with one uniform per row, in float64. A row's token depends only on its
probabilities and its own uniform, so a seeded request gets the same tokens alone or in any
batch. The same helpers give the verifier its uniforms and its bonus-token draws.

Randomness, per row:
- a row with its own ``torch.Generator`` draws only from it, in a fixed order;
- rows whose generator is None draw together, as one block in row order, from
  ``default_generator`` (the global RNG of the device when that is None too). Their draws
  therefore depend on the batch, which is fine: nothing promised them reproducibility;
- one-hot rows (greedy, or any row with a single possible token) draw nothing, so greedy
  results never touch any RNG state.

Who draws can also be told from the host (``random_rows``: the rows whose sampling parameters
are not greedy): then a random row draws its uniform even when its row happens to be one-hot
(the uniform cannot change a one-hot row's token), and the rows are never read on the host. The
engine does this, so a round's sampling needs no device-to-host sync; which rows draw is still a
function of each row's own parameters, so a seeded request stays reproducible alone or in any
batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ssd_engine.utils.host_upload import to_device


def sample(
    probs: Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    random_rows: Sequence[bool] | None = None,
) -> Tensor:
    """[n, V] probability rows (need not be normalised) -> [n] int64 sampled tokens.

    random_rows[i]: row i may be random and draws one uniform; the others must be one-hot and
    draw none. None: decided from the rows (reads them on the host)."""
    if random_rows is None:
        deterministic = (probs > 0).sum(dim=-1) == 1
        counts = (~deterministic).long().tolist()
    else:
        counts = [int(r) for r in random_rows]
    u = draw_uniforms(generators, counts, 1, probs.device, default_generator)
    # A one-hot row gets u = 0, which selects its only positive token: no RNG needed.
    return inverse_cdf(probs, u[:, 0])


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Token i such that cdf[i-1] <= u * total < cdf[i], per row; never a zero-probability token.

    probs: [n, V] non-negative float32 rows with a positive total (they need not sum to 1).
    u: [n] uniforms in [0, 1). Five launches on a GPU, the whole draw.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # right=True returns the first index whose cdf is strictly above the target; its cdf rose there,
    # so its probability is positive, as long as the target stays below the total. u * total can
    # round up to the total: the cap is the largest double below it (a float32 row's positive total
    # is at least 2**-149, far from doubles too small to have one below them within half an ulp).
    target = torch.minimum(u.to(torch.float64).unsqueeze(1) * total, total * (1 - 2.0**-53))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _rows_mask(rows: list[int], n: int) -> Tensor:
    mask = torch.zeros(n, 1, dtype=torch.bool)
    mask[rows] = True
    return mask


def draw_uniforms(
    generators: Sequence[torch.Generator | None],
    counts: Sequence[int],
    width: int,
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> Tensor:
    """[n, width] float64 uniforms in [0, 1) on `device`; zeros where a row needs none.

    Row i needs counts[i] <= width uniforms. A row with a generator draws exactly counts[i] from
    it. Rows with generator None and counts[i] > 0 draw from ``default_generator`` (or the global
    RNG of `device`) in one call for the whole batch, so the common unseeded batch costs one call.

    Where the draws happen: a host generator's (a seeded request's) on the host, all of them
    crossing to the device in one non-blocking copy; a device generator's on the device. Writing a
    host tensor into a device tensor would make the host wait for the stream (tests/instrumentation/sync_count.py).
    """
    if len(generators) != len(counts):
        raise ValueError(f"got {len(generators)} generators for {len(counts)} rows")
    device = torch.device(device)
    n = len(counts)
    host = torch.zeros(2, n, width, dtype=torch.float64)  # [0]: host draws; [1]: 1 where the shared block goes
    on_device, shared, from_host = [], [], []
    runs: list[list] = []  # [generator, uniforms]: consecutive host rows of one generator draw in one call
    for row, (gen, count) in enumerate(zip(generators, counts)):
        if count == 0:
            continue
        if gen is None:
            shared.append(row)
        elif gen.device.type == "cpu":
            from_host.append(row)
            if runs and runs[-1][0] is gen:
                runs[-1][1] += count
            else:
                runs.append([gen, count])
        else:
            on_device.append((row, gen, count))
    if from_host or shared:
        # the cells each row draws, row-major: a run's one draw fills its rows' cells in order, the
        # same uniforms as a draw per row (a CPU generator yields float64 uniforms one after another)
        drawing = torch.arange(width) < torch.tensor(counts).unsqueeze(1)
        if from_host:
            host[0][drawing & _rows_mask(from_host, n)] = torch.cat(
                [torch.rand(count, generator=gen, dtype=torch.float64) for gen, count in runs])
        if shared:
            host[1][drawing & _rows_mask(shared, n)] = 1.0
    block_device = default_generator.device if default_generator is not None else device
    if shared and block_device.type == "cpu":  # the shared draws are host draws too
        block = torch.rand(len(shared), width, generator=default_generator, dtype=torch.float64)
        rows = torch.tensor(shared)
        host[0, rows] = torch.where(host[1, rows] > 0, block, 0.0)
        shared = []
    u = to_device(host if shared else host[0], device)
    if shared:  # one block for the batch from the device generator, kept where a shared row draws
        block = torch.rand(n, width, generator=default_generator, device=block_device, dtype=torch.float64)
        u = torch.where(u[1] > 0, block, u[0])
    for row, gen, count in on_device:
        u[row, :count] = torch.rand(count, generator=gen, device=gen.device, dtype=torch.float64)
    return u
