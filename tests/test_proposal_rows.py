"""The SSD coordinator's proposal probabilities (speculative/ssd/proposal_rows.py): whole rows, supports
scattered on the device and one-hot rows land bit for bit where the verifier reads them."""

import pytest
import torch

from ssd_engine.speculative.ssd.proposal_rows import proposal_probs
from ssd_engine.speculative.ssd.protocol import SupportRows

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _support(k: int, ids: list[int], width: int, gen: torch.Generator) -> SupportRows:
    """K rows over `ids`, padded to `width` pairs with zero-probability ids (as a top_k slot is)."""
    pad = [i for i in range(100, 100 + width - len(ids))]
    values = torch.rand(k, len(ids), generator=gen) + 0.1
    values = torch.cat([values / values.sum(-1, keepdim=True), torch.zeros(k, len(pad))], dim=1)
    return SupportRows(torch.tensor([ids + pad] * k, dtype=torch.int32), values)


@pytest.mark.parametrize(
    "rows_on_device", [False, True]
)  # a reply decoded on the host, or held on the device
@pytest.mark.parametrize("device", DEVICES)
def test_every_row_kind_lands_bit_for_bit(device, rows_on_device):
    k, draft_vocab, target_vocab = (
        3,
        300,
        320,
    )  # the target's ids past the draft's get probability 0
    gen = torch.Generator().manual_seed(0)
    full = torch.rand(k, draft_vocab, generator=gen)
    full /= full.sum(-1, keepdim=True)
    # different top_k, so the narrower is padded with id 0; its real support holds id 0 too
    narrow, wide = _support(k, [0, 7, 299], 4, gen), _support(k, [5, 6, 8, 9, 10, 11], 8, gen)
    rows = full.to(device) if rows_on_device else full
    qs = [narrow, None, rows, wide, rows.clone()]
    probs = proposal_probs(qs, k, target_vocab, torch.device(device))
    assert probs.shape == (5, k, target_vocab) and probs.device.type == device
    expected = torch.zeros(5, k, target_vocab)
    expected[0, :, :draft_vocab] = narrow.dense(draft_vocab)
    expected[2, :, :draft_vocab] = full
    expected[3, :, :draft_vocab] = wide.dense(draft_vocab)
    expected[4, :, :draft_vocab] = full
    assert torch.equal(probs.cpu(), expected)
    assert bool((expected[0, :, 0] > 0).all())  # the real id 0 survived the padding's id 0


def test_support_rows_dense_is_exact():
    rows = SupportRows(
        torch.tensor([[3, 1, 0], [2, 0, 4]], dtype=torch.int32),
        torch.tensor([[0.25, 0.75, 0.0], [0.125, 0.875, 0.0]]),
    )
    assert torch.equal(
        rows.dense(5), torch.tensor([[0, 0.75, 0, 0.25, 0], [0.875, 0, 0.125, 0, 0]])
    )


@pytest.mark.parametrize("device", DEVICES)
def test_no_q_rows_means_no_probabilities(device):
    assert proposal_probs([None, None], 4, 10, torch.device(device)) is None
