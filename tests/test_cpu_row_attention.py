"""kernels/cpu_attention.cpp (`row_independent_attention` on CPU): the reference's values on random paged
and tree steps, and each query's bits unchanged by the other rows and keys of its step."""

import pytest
import torch
from paged_steps import paged_metadata, random_paged_step
from ssd_engine.kernels import gguf_cpu

from ssd_engine.layers.attention import row_independent_attention, torch_attention
from ssd_engine.speculative.ssd.draft.tree_mask import branch_metadata


@pytest.fixture(autouse=True)
def kernels():
    # asked when a test runs, not at collection: a first build takes ~40 s
    if not gguf_cpu.available():
        pytest.skip("the CPU kernels cannot be built here")


@pytest.mark.parametrize(
    "hq,hk,d,cache_dtype",
    [
        (4, 2, 32, torch.float32),
        (6, 3, 40, torch.float32),
        (8, 1, 24, torch.bfloat16),
        (12, 2, 128, torch.float32),
        (14, 2, 64, torch.bfloat16),
        (20, 1, 64, torch.float32),
    ],
)
def test_the_kernel_gives_the_references_values(hq, hk, d, cache_dtype):
    g = torch.Generator().manual_seed(d)
    q_lens = [int(x) for x in torch.randint(1, 7, (3,), generator=g)]
    meta, slots = random_paged_step(
        q_lens, [n + int(torch.randint(0, 40, (1,), generator=g)) for n in q_lens], 4, g
    )
    k_cache = torch.randn(slots, hk, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(slots, hk, d, generator=g).to(cache_dtype)
    q = torch.randn(meta.slot_mapping.shape[0], hq, d, generator=g)
    ref = torch_attention(q, k_cache.float(), v_cache.float(), meta, d**-0.5)
    torch.testing.assert_close(
        row_independent_attention(q, k_cache, v_cache, meta, d**-0.5), ref, atol=2e-5, rtol=2e-5
    )
    # a tree step (SSD's branches) over the same cache: two branches a row, each with its own path slots
    rows = len(q_lens)
    seq_of_branch = torch.arange(rows).repeat_interleave(2)
    visible = torch.clamp(meta.kv_lens.long()[seq_of_branch] - torch.tensor([0, 1] * rows), min=1)
    scratch = torch.randperm(slots, generator=g)[: 2 * rows * 3].view(2 * rows, 3)
    for step in range(3):
        tree = branch_metadata(
            meta.block_tables, seq_of_branch, visible, int(visible.max()), scratch, step, 4
        )
        qb = torch.randn(2 * rows, hq, d, generator=g)
        torch.testing.assert_close(
            row_independent_attention(qb, k_cache, v_cache, tree, d**-0.5),
            torch_attention(qb, k_cache.float(), v_cache.float(), tree, d**-0.5),
            atol=2e-5,
            rtol=2e-5,
        )


def test_a_querys_bits_do_not_depend_on_the_rest_of_its_step():
    """One decode query alone, then as the middle row of a step whose other rows have more queries
    and more keys (so its mask row is padded): the same bits."""
    g = torch.Generator().manual_seed(0)
    hq, hk, d, page = 12, 2, 128, 4
    k_cache, v_cache = torch.randn(4096, hk, d, generator=g), torch.randn(4096, hk, d, generator=g)
    q = torch.randn(1, hq, d, generator=g)
    alone = paged_metadata(torch.arange(10)[None], [1], [38], page)
    tables = torch.stack(
        [
            torch.arange(100, 150),
            torch.cat([torch.arange(10), torch.arange(200, 240)]),
            torch.arange(300, 350),
        ]
    )
    batch = paged_metadata(tables, [5, 1, 3], [190, 38, 120], page)
    others = torch.randn(8, hq, d, generator=g)
    in_batch = row_independent_attention(
        torch.cat([others[:5], q, others[5:8]]), k_cache, v_cache, batch, d**-0.5
    )
    assert torch.equal(
        in_batch[5:6], row_independent_attention(q, k_cache, v_cache, alone, d**-0.5)
    )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d", [(12, 2, 128), (14, 2, 64), (9, 3, 64)])
def test_a_steps_kv_groups_give_each_query_its_bits_alone(cache_dtype, hq, hk, d):
    """A step with a task for every thread walks each KV head's keys once for its query heads (the
    kernel's grouped path, in blocks of heads held in registers); a query alone on more threads than
    its KV heads takes a task per head. Each query's bits are the same."""
    g = torch.Generator().manual_seed(1)
    page = 4
    k_cache = torch.randn(2048, hk, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(2048, hk, d, generator=g).to(cache_dtype)
    threads = torch.get_num_threads()
    n = 8 * threads + 3
    q = torch.randn(n, hq, d, generator=g)
    long_step = paged_metadata(
        torch.arange(n // page + 8)[None], [n], [n + 17], page
    )  # a prefill chunk
    in_step = row_independent_attention(q, k_cache, v_cache, long_step, d**-0.5)
    torch.set_num_threads(hk + 1)  # one query's KV heads leave a thread idle: a task per head
    try:
        for i in (0, n // 2, n - 1):
            alone = paged_metadata(torch.arange(n // page + 8)[None], [1], [18 + i], page)
            assert torch.equal(
                in_step[i : i + 1],
                row_independent_attention(q[i : i + 1], k_cache, v_cache, alone, d**-0.5),
            )
    finally:
        torch.set_num_threads(threads)
