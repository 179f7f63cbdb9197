"""The verifier alone, no model: emitted tokens must follow the target distribution exactly.

Setup. Target rows p_1..p_{K+1} and draft rows q_1..q_K do not depend on the prefix, and draft
token x_j is drawn from q_j independently of everything else. Whether a draw reaches output
position j depends only on positions < j, so among the draws that reach position j the token
emitted there (accepted draft token, residual bonus, or the final bonus at j = K) must be
distributed exactly as p_{j+1}. In particular the first emitted token is always ~ p_1. One
`verify` call with N = 100,000 rows gives 100,000 independent draws per case.

Statistics. Each position with at least MIN_REACHED draws gets a chi-square goodness-of-fit test:
cells with expected count < 5 are pooled into one cell (grown with the next-smallest cells until
it reaches 5); a token with p = 0 that appears at all fails outright (p-value 0). Under H0 the
statistic is asymptotically chi-square with (#cells - 1) degrees of freedom; the p-value is its
survival function sf(x, k) = Q(k/2, x/2), the regularised upper incomplete gamma function
(``torch.special.gammaincc``), and a test fails when p < ALPHA = 1e-3 (equivalently the statistic
exceeds the critical value sf^-1(1e-3, dof)). This module asserts 44 such tests (43 positions
across the cases, printed per case with -s, plus one conditional test) and test_sampler.py one
more, so by Bonferroni the family-wise false-alarm probability is <= 45 * 1e-3 = 4.5%. All seeds
are fixed, so a given checkout passes or fails deterministically; the bound is over seed choices.

Acceptance at each position must equal sum_x min(p(x), q(x)) (sum_x w(x) p(x) for deterministic
proposals drawn from w) within 4 standard errors, SE = sqrt(a (1 - a) / N_reached).

Negative controls: two deliberately wrong verifiers (accept always; accept iff the draft token is
argmax p, bonus from p) go through the very same helper, and must be rejected with p < 1e-3:
this shows the check can see a bias of the kind that matters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from stats_helpers import chi_square_pvalue

from ssd_engine.sampling import rejection
from ssd_engine.sampling.rejection import VerifyResult, result_of, verify, verify_greedy
from ssd_engine.sampling.sampler import sample

ALPHA = 1e-3
DRAWS = 100_000
MIN_REACHED = 2_000
VOCAB_FOR_K = {1: 8, 3: 16, 7: 32}

Verifier = Callable[..., VerifyResult]


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    p: torch.Tensor  # [K+1, V] target rows
    q: torch.Tensor | None  # [K, V] rows passed to the verifier (None: deterministic proposals)
    proposal: torch.Tensor  # [K, V] what the draft tokens are actually drawn from

    @property
    def k(self) -> int:
        return self.proposal.shape[0]

    @property
    def vocab(self) -> int:
        return self.p.shape[1]

    def acceptance(self, j: int) -> float:
        """Probability that the draft token at position j is accepted."""
        if self.q is None:
            return float((self.proposal[j].double() * self.p[j].double()).sum())
        return float(torch.minimum(self.p[j], self.q[j]).double().sum())


def random_rows(
    rows: int, vocab: int, gen: torch.Generator, zero_fraction: float = 0.25
) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 1.5
    dropped = torch.rand(rows, vocab, generator=gen) < zero_fraction
    dropped[:, 0] = False  # keep every row non-empty
    return torch.softmax(logits.masked_fill(dropped, -math.inf), dim=-1)


def make_case(kind: str, k: int, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(1000 * k + seed)
    vocab = VOCAB_FOR_K[k]
    p = random_rows(k + 1, vocab, gen)
    if kind == "random":
        # Half p, half an independent random row, then some tokens removed: acceptance around
        # 0.5-0.7 so that later positions are reached, and both p and q have tokens the other lacks.
        q = random_rows(k, vocab, gen) + p[:k]
        q = q.masked_fill(torch.rand(k, vocab, generator=gen) < 0.2, 0.0)
        q[:, 0] += 1e-3 + (q.sum(-1) == 0)  # keep every row non-empty
        q = q / q.sum(-1, keepdim=True)
        return Case(f"{kind}-K{k}-V{vocab}", p, q, q)
    if kind == "random_full":  # full support: a biased verifier shows as a large statistic
        p = random_rows(k + 1, vocab, gen, zero_fraction=0.0)
        q = random_rows(k, vocab, gen, zero_fraction=0.0)
        return Case(f"{kind}-K{k}-V{vocab}", p, q, q)
    if kind == "equal":
        return Case(f"{kind}-K{k}-V{vocab}", p, p[:k].clone(), p[:k].clone())
    if kind == "disjoint":
        half = vocab // 2
        p = random_rows(k + 1, vocab, gen, zero_fraction=0.0)
        p[:, half:] = 0
        q = random_rows(k, vocab, gen, zero_fraction=0.0)
        q[:, :half] = 0
        return Case(
            f"{kind}-K{k}-V{vocab}", p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True), q
        )
    if kind == "onehot":
        # Deterministic proposals (q = None), drawn here from a mix of a sharpened p and uniform,
        # so some land on tokens p rules out. Exactness must hold for any proposal distribution.
        sharp = torch.softmax(3 * p[:k].log(), dim=-1)
        return Case(f"{kind}-K{k}-V{vocab}", p, None, 0.7 * sharp + 0.3 / vocab)
    raise ValueError(kind)


def draw_drafts(case: Case, n: int, gen: torch.Generator) -> torch.Tensor:
    columns = [
        torch.multinomial(case.proposal[j], n, replacement=True, generator=gen)
        for j in range(case.k)
    ]
    return torch.stack(columns, dim=1) if columns else torch.zeros(n, 0, dtype=torch.int64)


# --------------------------------------------------------------------------- the shared check


@dataclass
class Outcome:
    drafts: torch.Tensor  # [n, K]
    emitted: torch.Tensor  # [n, K+1], -1 past the end of each row's output
    num_accepted: torch.Tensor
    positions: list[tuple[int, int, float, int, float]]  # (j, reached, stat, dof, p-value)


def run_and_test_positions(
    verifier: Verifier, case: Case, n: int = DRAWS, seed: int = 0
) -> Outcome:
    """Run `verifier` on n draws of `case`; chi-square test the emitted token at each position."""
    gen = torch.Generator().manual_seed(seed)
    drafts = draw_drafts(case, n, gen)
    q = None if case.q is None else case.q.expand(n, -1, -1)
    result = verifier(drafts, q, case.p.expand(n, -1, -1), [None] * n, default_generator=gen)
    width = case.k + 1
    # emitted[i] = output_tokens[i] padded with -1; built from tensors for speed, checked on a slice.
    position = torch.arange(width)
    accepted = position[:-1] < result.num_accepted[:, None]
    emitted = torch.full((n, width), -1, dtype=torch.int64)
    emitted[:, :-1] = torch.where(accepted, drafts, -1)
    emitted.scatter_(1, result.num_accepted[:, None], result.bonus_tokens[:, None])
    head = [row + [-1] * (width - len(row)) for row in result.output_tokens[:2000]]
    assert emitted[:2000].tolist() == head
    positions = []
    for j in range(width):
        reached = emitted[:, j] >= 0
        count = int(reached.sum())
        if count < MIN_REACHED:
            continue
        tokens = torch.bincount(emitted[reached, j], minlength=case.vocab)
        stat, dof, p_value = chi_square_pvalue(tokens, case.p[j])
        positions.append((j, count, stat, dof, p_value))
        print(
            f"  {verifier.__name__:>18} {case.name:>18} pos {j}: n={count:6d} chi2={stat:8.2f} dof={dof:2d} p={p_value:.3g}"
        )
    return Outcome(drafts, emitted, result.num_accepted, positions)


# --------------------------------------------------------------------------- exactness


CASES = [(kind, k) for kind in ("random", "equal", "disjoint", "onehot") for k in (1, 3, 7)]


@pytest.mark.parametrize("kind, k", CASES + [("random_full", 3)])
def test_emitted_tokens_follow_target(kind, k):
    case = make_case(kind, k)
    outcome = run_and_test_positions(verify, case, seed=k)
    print(f"  {case.name}: {len(outcome.positions)} chi-square tests")
    assert outcome.positions and outcome.positions[0][0] == 0  # position 0 is always reached
    for j, _, stat, dof, p_value in outcome.positions:
        assert p_value > ALPHA, (
            f"{case.name} position {j}: chi2={stat:.1f} dof={dof} p={p_value:.2g}"
        )
    # Acceptance at every position with enough draws reaching it.
    for j in range(case.k):
        reached = outcome.num_accepted >= j
        count = int(reached.sum())
        if count < MIN_REACHED:
            continue
        rate = float((outcome.num_accepted[reached] > j).double().mean())
        a = min(case.acceptance(j), 1.0)  # float32 sums of min(p, q) can exceed 1 by an ulp
        se = math.sqrt(a * (1 - a) / count)
        print(
            f"  {case.name} acceptance pos {j}: observed {rate:.4f} expected {a:.4f} (SE {se:.2g})"
        )
        assert abs(rate - a) <= 4 * se + 1e-6, (
            f"{case.name} position {j}: acceptance {rate:.4f} vs {a:.4f}"
        )
    if kind == "equal":
        assert bool((outcome.num_accepted == k).all())  # q == p accepts with probability 1
    if kind == "disjoint":
        assert bool((outcome.num_accepted == 0).all())


def test_second_token_given_first_accepted_token():
    case = make_case("random", 3)
    outcome = run_and_test_positions(verify, case, seed=11)
    first_accepted = outcome.num_accepted >= 1
    token = int(torch.mode(outcome.drafts[first_accepted, 0]).values)
    given = first_accepted & (outcome.drafts[:, 0] == token)
    counts = torch.bincount(outcome.emitted[given, 1], minlength=case.vocab)
    stat, dof, p_value = chi_square_pvalue(counts, case.p[1])
    print(
        f"  second token | x_1={token} accepted: n={int(given.sum())} chi2={stat:.2f} dof={dof} p={p_value:.3g}"
    )
    assert p_value > ALPHA


# --------------------------------------------------------------------------- negative controls


def accept_always(
    draft_tokens, draft_probs, target_probs, generators, num_draft=None, default_generator=None
):
    """WRONG: emits every draft token, then a bonus from p_{K+1}."""
    n, k = draft_tokens.shape
    bonus = sample(target_probs[:, k], generators, default_generator)
    return result_of(draft_tokens.long(), torch.full((n,), k), bonus)


def accept_if_argmax(
    draft_tokens, draft_probs, target_probs, generators, num_draft=None, default_generator=None
):
    """WRONG at T > 0: accepts x iff x == argmax p, then a bonus from p (not the residual)."""
    n, k = draft_tokens.shape
    match = draft_tokens == target_probs[:, :k].argmax(-1)
    num_accepted = match.long().cumprod(1).sum(1)
    bonus = sample(target_probs[torch.arange(n), num_accepted], generators, default_generator)
    return result_of(draft_tokens.long(), num_accepted, bonus)


@pytest.mark.parametrize("broken", [accept_always, accept_if_argmax])
def test_negative_controls_are_caught(broken):
    # The real verifier passes this very case in test_emitted_tokens_follow_target[random_full-3].
    case = make_case("random_full", 3)
    bad = run_and_test_positions(broken, case, seed=5)
    j, _, stat, _, p_value = bad.positions[0]
    assert j == 0 and math.isfinite(stat) and p_value < ALPHA, f"{broken.__name__} not caught"


# --------------------------------------------------------------------------- greedy and bookkeeping


def greedy_loop(
    drafts: list[list[int]], argmax: list[list[int]], num_draft: list[int]
) -> list[list[int]]:
    out = []
    for row, best, nd in zip(drafts, argmax, num_draft):
        emitted = []
        for j in range(nd):
            if row[j] != best[j]:
                break
            emitted.append(row[j])
        out.append(emitted + [best[len(emitted)]])
    return out


def test_verify_greedy_matches_loop():
    gen = torch.Generator().manual_seed(0)
    n, k, vocab = 500, 5, 4  # small vocab: plenty of matches
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    argmax = torch.randint(0, vocab, (n, k + 1), generator=gen)
    argmax[: n // 3, :k] = drafts[: n // 3]  # some rows accept everything
    num_draft = torch.randint(0, k + 1, (n,), generator=gen)
    padded = torch.where(torch.arange(k) < num_draft[:, None], drafts, -1)
    result = verify_greedy(padded, argmax, num_draft)
    assert result.output_tokens == greedy_loop(drafts.tolist(), argmax.tolist(), num_draft.tolist())
    assert result.num_accepted.tolist() == [len(t) - 1 for t in result.output_tokens]
    assert result.bonus_tokens.tolist() == [t[-1] for t in result.output_tokens]
    full = verify_greedy(drafts, argmax)
    assert full.output_tokens == greedy_loop(drafts.tolist(), argmax.tolist(), [k] * n)


@pytest.mark.parametrize("q_kind", ["none", "one_hot", "random"])
def test_one_hot_target_through_verify_equals_verify_greedy(q_kind):
    gen = torch.Generator().manual_seed(1)
    n, k, vocab = 300, 4, 6
    target = torch.softmax(torch.randn(n, k + 1, vocab, generator=gen), -1)
    argmax = target.argmax(-1)
    one_hot_p = torch.nn.functional.one_hot(argmax, vocab).float()
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    drafts[: n // 2] = argmax[: n // 2, :k]
    if q_kind == "none":
        q = None
    elif q_kind == "one_hot":
        q = torch.nn.functional.one_hot(drafts, vocab).float()
    else:  # any q that could have produced the drafts
        q = torch.softmax(torch.randn(n, k, vocab, generator=gen), -1)
    num_draft = torch.randint(0, k + 1, (n,), generator=gen)
    shared = torch.Generator().manual_seed(2)
    state = shared.get_state()
    result = verify(drafts, q, one_hot_p, [None] * n, num_draft, default_generator=shared)
    assert result.output_tokens == verify_greedy(drafts, argmax, num_draft).output_tokens
    assert torch.equal(shared.get_state(), state)  # greedy rows draw no randomness


def test_explicit_one_hot_q_equals_none():
    case = make_case("onehot", 3)
    n = 2_000
    drafts = draw_drafts(case, n, torch.Generator().manual_seed(3))
    p = case.p.expand(n, -1, -1)
    one_hot_q = torch.nn.functional.one_hot(drafts, case.vocab).float()
    a = verify(drafts, None, p, [None] * n, default_generator=torch.Generator().manual_seed(4))
    b = verify(drafts, one_hot_q, p, [None] * n, default_generator=torch.Generator().manual_seed(4))
    assert a.output_tokens == b.output_tokens


def random_batch(n: int, k: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, k + 1, vocab, generator=gen), -1)
    q = torch.softmax(torch.randn(n, k, vocab, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(n, k)
    return drafts, q, p


def test_num_draft_padding_equals_truncated_rows():
    n, k, vocab = 40, 5, 10
    drafts, q, p = random_batch(n, k, vocab, seed=5)
    num_draft = torch.arange(n) % (k + 1)
    padded = torch.where(torch.arange(k) < num_draft[:, None], drafts, -1)  # padding is garbage
    gens = [torch.Generator().manual_seed(100 + i) for i in range(n)]
    batch = verify(padded, q, p, gens, num_draft)
    for i in range(n):
        nd = int(num_draft[i])
        alone = verify(
            drafts[i : i + 1, :nd],
            q[i : i + 1, :nd],
            p[i : i + 1, : nd + 1],
            [torch.Generator().manual_seed(100 + i)],
        )
        assert batch.output_tokens[i] == alone.output_tokens[0]
        assert len(batch.output_tokens[i]) <= nd + 1
        assert -1 not in batch.output_tokens[i]


def test_seeded_rows_reproduce_alone_and_in_any_batch():
    n, k, vocab = 24, 4, 12
    drafts, q, p = random_batch(n, k, vocab, seed=6)

    def gens() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(7 * i) if i % 3 else None for i in range(n)]

    seeded = [i for i in range(n) if i % 3]  # unseeded rows share the global RNG
    first = verify(drafts, q, p, gens())
    again = verify(drafts, q, p, gens())
    assert [first.output_tokens[i] for i in seeded] == [again.output_tokens[i] for i in seeded]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(8))
    fresh = gens()
    permuted_gens = [fresh[i] for i in perm.tolist()]
    shuffled = verify(drafts[perm], q[perm], p[perm], permuted_gens)
    for new_row, old_row in enumerate(perm.tolist()):
        if old_row in seeded:
            assert shuffled.output_tokens[new_row] == first.output_tokens[old_row]


def test_zero_residual_falls_back_to_p(monkeypatch):
    # p sums to just under 1, so p <= q everywhere and a rejection leaves an all-zero residual.
    p = torch.tensor([[[0.3, 0.7 - 1e-6, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[0.3, 0.7, 0.0]]])
    drafts = torch.tensor([[1]])
    almost_one = lambda gens, counts, width, device, default=None: torch.full(
        (1, width), 1 - 1e-9, dtype=torch.float64
    )
    monkeypatch.setattr(rejection, "draw_uniforms", almost_one)
    result = verify(drafts, q, p, [None])
    assert result.num_accepted.tolist() == [0]
    assert result.output_tokens == [[1]]  # drawn from p, never the zero-probability token 2


def test_zero_draft_tokens():
    p = torch.softmax(torch.randn(3, 1, 5, generator=torch.Generator().manual_seed(9)), -1)
    result = verify(
        torch.zeros(3, 0, dtype=torch.int64),
        None,
        p,
        [torch.Generator().manual_seed(i) for i in range(3)],
    )
    assert result.num_accepted.tolist() == [0, 0, 0] and all(
        len(t) == 1 for t in result.output_tokens
    )
    greedy = verify_greedy(torch.zeros(3, 0, dtype=torch.int64), p.argmax(-1))
    assert greedy.output_tokens == [[int(t)] for t in p[:, 0].argmax(-1)]


def test_chi_square_helper_critical_values():
    # sf at the textbook critical values: chi2(1) 3.8415 -> 0.05, chi2(10) 29.588 -> 0.001.
    for dof, x, alpha in [
        (1, 3.841458820694124, 0.05),
        (10, 29.58829844507442, 1e-3),
        (30, 59.70306, 1e-3),
    ]:
        sf = float(
            torch.special.gammaincc(
                torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
            )
        )
        assert math.isclose(sf, alpha, rel_tol=1e-4)
    # Pooling: many tiny cells become one.
    probs = torch.tensor([0.5, 0.49] + [0.001] * 10)
    stat, dof, p_value = chi_square_pvalue(torch.tensor([500, 490] + [1] * 10), probs)
    assert dof == 2 and stat == pytest.approx(0.0, abs=1e-9) and p_value == pytest.approx(1.0)
