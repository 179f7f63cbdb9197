"""Triton masked-gather (tree-branch / decode) attention vs. the torch reference.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before the kernel module
is imported); on a CUDA machine the same tests run the compiled kernel on the GPU.
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from kernels.tree_attention import masked_gather_attention, reference_masked_gather_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
S = 300


def _make_inputs(B, Hq, Hk, D, L, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g)
    k_cache = torch.randn(S, Hk, D, generator=g)
    v_cache = torch.randn(S, Hk, D, generator=g)
    # each row gathers its own scattered subset of slots
    slots = torch.stack([torch.randperm(S, generator=g)[:L] for _ in range(B)])
    mask = torch.rand(B, L, generator=g) < 0.6
    mask[torch.arange(B), torch.randint(0, L, (B,), generator=g)] = True  # >= 1 key per row
    if L > 4:  # row 0 like a tree branch: trunk prefix + its own path at the end, siblings hidden
        trunk, own = (2 * L) // 3, max(1, L // 10)
        mask[0] = False
        mask[0, :trunk] = True
        mask[0, L - own:] = True
    to = lambda t: t.to(DEVICE)
    return to(q), to(k_cache), to(v_cache), to(slots), to(mask)


@pytest.mark.parametrize("L", [7, 70, 130])
@pytest.mark.parametrize("B", [1, 5])
@pytest.mark.parametrize("D", [16, 40, 64])
@pytest.mark.parametrize("Hq,Hk", [(4, 4), (6, 2), (8, 1)])
def test_matches_reference(Hq, Hk, D, B, L):
    q, k_cache, v_cache, slots, mask = _make_inputs(B, Hq, Hk, D, L, seed=Hq * 1000 + D * 10 + B + L)
    scale = D ** -0.5
    out = masked_gather_attention(q, k_cache, v_cache, slots, mask, scale)
    ref = reference_masked_gather_attention(q, k_cache, v_cache, slots, mask, scale)
    assert out.shape == (B, Hq, D) and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_masked_keys_do_not_leak():
    B, Hq, Hk, D, L = 3, 4, 2, 40, 70
    q, k_cache, v_cache, _, mask = _make_inputs(B, Hq, Hk, D, L, seed=7)
    # every (row, key) gets its own slot, so poisoning a hidden key's slot touches no visible key
    slots = torch.randperm(S, generator=torch.Generator().manual_seed(7))[: B * L].view(B, L).to(DEVICE)
    hidden = slots[~mask]
    v_cache[hidden] = 1e6  # any weight on a masked key shows up as a huge output
    k_cache[hidden] = 50.0  # ... and would dominate the softmax if it were scored
    out = masked_gather_attention(q, k_cache, v_cache, slots, mask, D ** -0.5)
    assert torch.isfinite(out).all()
    assert out.abs().max().item() < 10.0
    ref = reference_masked_gather_attention(q, k_cache, v_cache, slots, mask, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_padding_slots_never_read():
    B, Hq, Hk, D, L = 2, 6, 2, 16, 70
    q, k_cache, v_cache, slots, mask = _make_inputs(B, Hq, Hk, D, L, seed=11)
    ref = reference_masked_gather_attention(q, k_cache, v_cache, slots, mask, 0.25)
    # the caches are views of buffers with one extra poisoned row at slot S; hidden keys point there,
    # so a kernel that dereferences them blows up the output (without reading outside the allocation)
    k_buf = torch.cat([k_cache, torch.full_like(k_cache[:1], 50.0)])
    v_buf = torch.cat([v_cache, torch.full_like(v_cache[:1], 1e6)])
    padded = slots.masked_fill(~mask, S)
    out = masked_gather_attention(q, k_buf[:S], v_buf[:S], padded, mask, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
