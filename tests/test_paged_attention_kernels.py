"""Triton paged and tree-mask attention against a naive per-row torch reference.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the kernel module
is imported); on a CUDA machine the same tests run the compiled kernels on the GPU. Shapes are drawn
at random: ragged query and key lengths, scattered pages, GQA groups, head dims that are not powers
of two. The reference is written per row and per query with plain indexing, independent of the
engine's vectorised dense masks.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ssd_engine.kernels.paged_attention import paged_attention, tree_attention  # noqa: E402

# an object, as the engine names its device: what tests/instrumentation/placement.py takes for the accelerator
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS = [(4, 4), (6, 2), (8, 1), (12, 2)]

# a GPU runs these tests (scripts/gpu_check.sh): each also fails in CI where a host tensor meets the device
CHECK_PLACEMENT = True


def attend(q, keys, values, scale):
    """q [Hq, D], keys/values [L, Hk, D] -> [Hq, D] (GQA: head h reads kv head h // (Hq // Hk))."""
    group = q.shape[0] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.float(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", p, v)


def slots_of(table, n, page):
    return [table[j // page] * page + j % page for j in range(n)]


def random_cache(g, pages, page, hk, d, dtype):
    k = torch.randn(pages * page, hk, d, generator=g).to(dtype)
    v = torch.randn(pages * page, hk, d, generator=g).to(dtype)
    return k, v


def random_tables(g, rows, blocks_each, blocks_total):
    """Each row its own scattered pages (a permutation, so rows never share a page by accident)."""
    perm = torch.randperm(blocks_total, generator=g)[: rows * blocks_each]
    return perm.view(rows, blocks_each).to(torch.int32)


@pytest.mark.parametrize("seed", range(12))
def test_paged_attention_matches_reference_on_random_shapes(seed):
    g = torch.Generator().manual_seed(seed)
    hq, hk = HEADS[seed % len(HEADS)]
    d = [16, 40, 64, 24][seed % 4]
    page = [4, 16, 8][seed % 3]
    rows = int(torch.randint(1, 5, (1,), generator=g))
    # ragged: decode rows (1 query), verification rows (K + 1), prefill chunks (many)
    q_lens = [int(x) for x in torch.randint(1, 20, (rows,), generator=g)]
    q_lens[0] = 1
    kv_lens = [ql + int(torch.randint(0, 70, (1,), generator=g)) for ql in q_lens]
    blocks_each = max(-(-n // page) for n in kv_lens) + 1
    tables = random_tables(g, rows, blocks_each, rows * blocks_each + 3)
    k_cache, v_cache = random_cache(g, rows * blocks_each + 3, page, hk, d, torch.float32)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    scale = d**-0.5

    to = lambda t: t.to(DEVICE)
    for splits in (1, 1 + seed % 5):  # split-KV: partial softmaxes over key spans, merged
        out = paged_attention(
            to(q),
            to(k_cache),
            to(v_cache),
            to(tables),
            to(torch.tensor(kv_lens, dtype=torch.int32)),
            to(starts),
            max(q_lens),
            page,
            scale,
            splits=splits,
        ).cpu()
        for b in range(rows):
            slots = slots_of(tables[b].tolist(), kv_lens[b], page)
            for i in range(q_lens[b]):
                seen = slots[: kv_lens[b] - q_lens[b] + i + 1]  # causal
                t = int(starts[b]) + i
                expected = attend(q[t], k_cache[seen], v_cache[seen], scale)
                torch.testing.assert_close(out[t], expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("seed", range(8))
def test_tree_attention_matches_reference_on_random_shapes(seed):
    g = torch.Generator().manual_seed(100 + seed)
    hq, hk = HEADS[seed % len(HEADS)]
    d = [32, 40, 16, 64][seed % 4]
    page, k = [16, 4][seed % 2], 1 + seed % 4
    seqs = 1 + seed % 3
    trunk_lens = [int(x) for x in torch.randint(3, 60, (seqs,), generator=g)]
    blocks_each = max(-(-n // page) for n in trunk_lens)
    total_blocks = seqs * blocks_each + -(-(40 * k) // page) + 2
    tables = random_tables(g, seqs, blocks_each, total_blocks - -(-(40 * k) // page))
    k_cache, v_cache = random_cache(g, total_blocks, page, hk, d, torch.float32)
    branches = int(torch.randint(1, 9, (1,), generator=g))
    table_rows = torch.randint(0, seqs, (branches,), generator=g).to(torch.int32)
    # a branch forks somewhere inside its trunk (committed + first k accepted drafts)
    visible = torch.tensor(
        [int(torch.randint(1, trunk_lens[s] + 1, (1,), generator=g)) for s in table_rows.tolist()],
        dtype=torch.int32,
    )
    scratch_base = seqs * blocks_each * page  # scratch region after every trunk page
    path_slots = (scratch_base + torch.randperm(40 * k, generator=g)[: branches * k]).view(
        branches, k
    )
    q = torch.randn(branches, hq, d, generator=g)
    scale = d**-0.5
    for path_len in range(1, k + 1):
        to = lambda t: t.to(DEVICE)
        path_lens = torch.full((branches,), path_len, dtype=torch.int32)
        path_lens[0] = 1 + (path_len - 1) // 2  # rows may stand at different depths
        out = tree_attention(
            to(q),
            to(k_cache),
            to(v_cache),
            to(tables),
            to(table_rows),
            to(visible),
            to(path_slots),
            to(path_lens),
            page,
            scale,
            splits=1 + (seed + path_len) % 3,
        ).cpu()
        for r in range(branches):
            seen = (
                slots_of(tables[table_rows[r]].tolist(), int(visible[r]), page)
                + path_slots[r, : int(path_lens[r])].tolist()
            )
            expected = attend(q[r], k_cache[seen], v_cache[seen], scale)
            torch.testing.assert_close(out[r], expected, atol=2e-4, rtol=2e-4)


def test_tree_attention_never_reads_siblings_or_keys_past_the_fork():
    """Poison every slot a branch must not see (siblings' paths, its own later path slots, trunk
    positions past its fork point, unused pages) with NaN: a single read would turn its output NaN."""
    g = torch.Generator().manual_seed(3)
    hq, hk, d, page, k = 6, 2, 32, 8, 3
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    k_cache, v_cache = random_cache(g, 10, page, hk, d, torch.float32)
    table_rows = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    visible = torch.tensor([5, 11, 20, 1], dtype=torch.int32)
    path_slots = torch.arange(48, 60).view(4, k)
    step = 1
    allowed = set()
    for r in range(4):
        allowed |= set(slots_of(tables[table_rows[r]].tolist(), int(visible[r]), page))
        allowed |= set(path_slots[r, : step + 1].tolist())
    poison = torch.tensor([s not in allowed for s in range(k_cache.shape[0])])
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    q = torch.randn(4, hq, d, generator=g)
    to = lambda t: t.to(DEVICE)
    out = tree_attention(
        to(q),
        to(k_cache),
        to(v_cache),
        to(tables),
        to(table_rows),
        to(visible),
        to(path_slots),
        to(torch.full((4,), step + 1, dtype=torch.int32)),
        page,
        d**-0.5,
        splits=3,
    ).cpu()
    assert torch.isfinite(out).all()


def test_paged_attention_never_reads_future_or_foreign_pages():
    g = torch.Generator().manual_seed(5)
    hq, hk, d, page = 4, 2, 16, 4
    tables = torch.tensor([[2, 0, 7], [5, 1, 3]], dtype=torch.int32)
    kv_lens = [9, 6]
    k_cache, v_cache = random_cache(g, 8, page, hk, d, torch.float32)
    allowed = set(slots_of(tables[0].tolist(), 9, page)) | set(
        slots_of(tables[1].tolist(), 6, page)
    )
    poison = torch.tensor([s not in allowed for s in range(k_cache.shape[0])])
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    q = torch.randn(4, hq, d, generator=g)
    starts = torch.tensor([0, 3, 4], dtype=torch.int32)
    to = lambda t: t.to(DEVICE)
    out = paged_attention(
        to(q),
        to(k_cache),
        to(v_cache),
        to(tables),
        to(torch.tensor(kv_lens, dtype=torch.int32)),
        to(starts),
        3,
        page,
        d**-0.5,
    ).cpu()
    assert torch.isfinite(out).all()
    # the first query of row 0 sees keys 0..6 only: changing key 7 (its future) must not move it
    k2 = k_cache.clone()
    k2[slots_of(tables[0].tolist(), 9, page)[7]] += 5.0
    out2 = paged_attention(
        to(q),
        to(k2),
        to(v_cache),
        to(tables),
        to(torch.tensor(kv_lens, dtype=torch.int32)),
        to(starts),
        3,
        page,
        d**-0.5,
    ).cpu()
    torch.testing.assert_close(out2[0], out[0])
    assert not torch.allclose(out2[1], out[1])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bfloat16 kernel path is checked on a CUDA GPU only"
)
def test_paged_attention_bf16_close_to_fp32_reference():
    g = torch.Generator().manual_seed(9)
    hq, hk, d, page = 12, 2, 128, 16
    tables = random_tables(g, 3, 8, 30)
    k_cache, v_cache = random_cache(g, 30, page, hk, d, torch.float32)
    kv_lens = [100, 5, 77]
    q = torch.randn(11, hq, d, generator=g)
    starts = torch.tensor([0, 1, 6, 11], dtype=torch.int32)
    args = (
        tables.cuda(),
        torch.tensor(kv_lens, dtype=torch.int32).cuda(),
        starts.cuda(),
        5,
        page,
        d**-0.5,
    )
    fp32 = paged_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), *args)
    bf16 = paged_attention(
        q.cuda().bfloat16(), k_cache.cuda().bfloat16(), v_cache.cuda().bfloat16(), *args
    )
    torch.testing.assert_close(bf16.float(), fp32, atol=3e-2, rtol=3e-2)


def test_kernel_compiles_to_cubin_for_a100_and_h100():
    """Lower every engine step shape through ptxas for sm_80 / sm_90 without a GPU (a subprocess,
    since this module turned the interpreter on): type, `tl.dot` shape and resource errors show here."""
    import subprocess

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this triton build has no NVIDIA backend (ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "ssd_engine.kernels.compile_check"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    from ssd_engine.kernels.compile_check import OTHER_KERNELS, VARIANTS

    compiled = done.stdout.count("\nok ") + done.stdout.startswith("ok ")
    assert compiled == 2 * (len(VARIANTS) + len(OTHER_KERNELS)), done.stdout  # sm_80 and sm_90 each
