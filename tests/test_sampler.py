"""sample(): per-row generators, greedy without RNG, frequencies match the rows.

The frequency check is a chi-square goodness-of-fit test at alpha = 1e-3 (cells with expected
count < 5 pooled; critical value from the chi-square survival function, computed as
gammaincc(dof / 2, stat / 2)); the helper lives in tests/stats_helpers.py.
"""

import torch
from stats_helpers import chi_square_pvalue

from ssd_engine.sampling.sampler import draw_uniforms, inverse_cdf, sample

ALPHA = 1e-3


def test_frequencies_match_probs():
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)) * 2, -1)
    probs[[3, 17, 41]] = 0.0  # zero-probability tokens must never appear
    n = 100_000
    tokens = sample(
        probs.expand(n, -1), [None] * n, default_generator=torch.Generator().manual_seed(1)
    )
    counts = torch.bincount(tokens, minlength=50)
    stat, dof, p_value = chi_square_pvalue(counts, probs)
    print(f"\nsampler chi2: stat={stat:.2f} dof={dof} p={p_value:.3g}")
    assert counts[[3, 17, 41]].sum() == 0
    assert p_value > ALPHA


def test_seeded_row_is_the_same_alone_and_in_a_batch():
    def run(batch: bool) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        others = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]
        out = []
        for step in range(20):
            row = torch.softmax(torch.randn(30, generator=torch.Generator().manual_seed(step)), -1)
            if batch:
                probs = torch.stack([row.flip(0), row, torch.full((30,), 1 / 30), row.roll(3)])
                token = sample(probs, [others[0], gen, others[1], others[2]])[1]
            else:
                token = sample(row[None], [gen])[0]
            out.append(int(token))
        return out

    assert run(batch=False) == run(batch=True)


def test_greedy_rows_consume_no_randomness():
    gen = torch.Generator().manual_seed(5)
    shared = torch.Generator().manual_seed(6)
    state, shared_state, global_state = gen.get_state(), shared.get_state(), torch.get_rng_state()
    one_hot = torch.zeros(3, 10)
    one_hot[0, 4] = one_hot[1, 0] = one_hot[2, 9] = 1.0
    assert sample(one_hot, [gen, None, None], default_generator=shared).tolist() == [4, 0, 9]
    assert sample(one_hot, [None, None, None]).tolist() == [4, 0, 9]
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(shared.get_state(), shared_state)
    assert torch.equal(torch.get_rng_state(), global_state)


def test_unseeded_rows_use_the_default_generator():
    probs = torch.full((6, 12), 1 / 12)
    a = sample(probs, [None] * 6, default_generator=torch.Generator().manual_seed(3))
    b = sample(probs, [None] * 6, default_generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_inverse_cdf_top_end_never_returns_zero_probability_token():
    probs = torch.tensor(
        [[0.0, 0.3, 0.7, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0], [1e-30, 0.5, 0.0, 0.5, 0.0]]
    )
    top = torch.full((3,), 1.0 - 2.0**-53, dtype=torch.float64)
    assert inverse_cdf(probs, top).tolist() == [2, 0, 3]
    assert inverse_cdf(probs, torch.zeros(3, dtype=torch.float64)).tolist() == [1, 0, 0]
    # Rows need not be normalised.
    assert inverse_cdf(probs * 7, torch.full((3,), 0.4, dtype=torch.float64)).tolist() == [2, 0, 1]


def test_draw_uniforms_per_row_order():
    gen = torch.Generator().manual_seed(9)
    u = draw_uniforms(
        [gen, None], [3, 2], 4, "cpu", default_generator=torch.Generator().manual_seed(1)
    )
    expected = torch.rand(3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert torch.equal(u[0, :3], expected) and u[0, 3] == 0


def test_rows_of_one_generator_draw_as_if_each_row_drew_alone():
    """Consecutive rows of one generator (a draft's branches of one sequence) are drawn in one call:
    each row still gets exactly the uniforms a draw per row, in row order, would give it."""
    a, b = (torch.Generator().manual_seed(s) for s in (5, 6))
    gens, counts = [a, a, a, b, None, a, b], [1, 2, 0, 3, 2, 1, 0]
    u = draw_uniforms(gens, counts, 3, "cpu", default_generator=torch.Generator().manual_seed(1))
    a, b = (torch.Generator().manual_seed(s) for s in (5, 6))
    shared = torch.rand(1, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)[0]
    for row, (gen, count) in enumerate(zip([a, a, a, b, None, a, b], counts)):
        drawn = (
            shared[:count] if gen is None else torch.rand(count, generator=gen, dtype=torch.float64)
        )
        assert torch.equal(u[row, :count], drawn) and not u[row, count:].any(), row
