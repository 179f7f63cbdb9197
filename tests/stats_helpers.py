"""Chi-square helpers shared by the sampler, verifier and distribution tests.

`chi_square_pvalue`: goodness of fit of observed counts against probabilities; cells with expected
count < 5 are pooled (growing the pooled cell with the smallest big cells until it reaches 5). The
p-value is the chi-square survival function, gammaincc(dof / 2, stat / 2).

`gof_power`: the power of that test against the least favourable alternative at total variation d.
Under an alternative q = p + delta the statistic is approximately noncentral chi-square with
lambda = n * sum_i delta_i^2 / p_i, and by Cauchy-Schwarz (sum|delta_i|)^2 <= (sum delta_i^2 / p_i)
(sum p_i), so lambda >= 4 n d^2 for ANY shift of total variation d on the tested (pooled) cells,
with equality when |delta_i| is proportional to p_i. Power = P(chi2'(dof, 4 n d^2) > chi2^-1_{1-alpha}(dof)),
the noncentral tail computed as a Poisson mixture of central tails (`ncx2_sf`).
"""

import math

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """(statistic, dof, p-value) of observed counts against probabilities; p = 0 if an impossible cell was hit."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    if counts[probs == 0].sum() > 0:
        return float("inf"), 0, 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    obs_cells, exp_cells = list(counts[big]), list(expected[big])
    small_obs, small_exp = counts[~big & (probs > 0)].sum(), expected[~big & (probs > 0)].sum()
    order = sorted(range(len(exp_cells)), key=lambda i: float(exp_cells[i]))
    while 0 < small_exp < 5 and order:  # grow the pooled cell with the smallest big cells
        i = order.pop(0)
        small_obs, small_exp = small_obs + obs_cells[i], small_exp + exp_cells[i]
        obs_cells[i] = exp_cells[i] = None
    obs = [o for o in obs_cells if o is not None] + ([small_obs] if small_exp > 0 else [])
    exp = [e for e in exp_cells if e is not None] + ([small_exp] if small_exp > 0 else [])
    obs_t, exp_t = torch.stack(obs), torch.stack(exp)
    stat = float(((obs_t - exp_t) ** 2 / exp_t).sum())
    dof = len(exp) - 1
    p_value = float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2))
    )
    return stat, dof, p_value


def fit(sample, law: dict) -> tuple[float, int, float, int]:
    """Goodness of fit of `sample` (a Counter of outcomes) against `law` ({outcome: probability})
    -> (statistic, dof, p-value, n)."""
    cells = sorted(set(law) | set(sample))
    counts = torch.tensor([sample[c] for c in cells], dtype=torch.float64)
    probs = torch.tensor([law.get(c, 0.0) for c in cells], dtype=torch.float64)
    stat, dof, p = chi_square_pvalue(counts, probs)
    return stat, dof, p, int(counts.sum())


def chi2_sf(x: float, dof: int) -> float:
    if dof <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
        )
    )


def chi2_isf(alpha: float, dof: int) -> float:
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > alpha else (lo, mid)
    return (lo + hi) / 2


def ncx2_sf(x: float, dof: int, lam: float) -> float:
    """P(noncentral chi2(dof, lam) > x) = sum_j Poisson(j; lam/2) * P(chi2(dof + 2j) > x)."""
    half = lam / 2
    terms = int(half + 12 * math.sqrt(half) + 30)
    j = torch.arange(terms, dtype=torch.float64)
    weights = (
        torch.exp(-half + j * math.log(half) - torch.lgamma(j + 1))
        if half > 0
        else (j == 0).double()
    )
    tails = torch.special.gammaincc((dof + 2 * j) / 2, torch.full_like(j, x / 2))
    return float((weights * tails).sum())


def gof_power(dof: int, n: int, tv: float, alpha: float) -> float:
    """Power of the goodness-of-fit test against the least favourable shift of total variation `tv`."""
    dof = max(dof, 1)
    return ncx2_sf(chi2_isf(alpha, dof), dof, 4 * tv**2 * n)


def check_law(
    label: str,
    sample,
    law: dict,
    metrics: dict,
    tv: float,
    alpha: float,
    design_power: float,
    acceptance: tuple[float, float],
) -> None:
    """`sample` fits `law` at level alpha, with power >= design_power against any shift of total variation
    tv, and the drafts' acceptance rate lies inside `acceptance` (both branches of verification ran)."""
    stat, dof, p, n = fit(sample, law)
    power = gof_power(dof, n, tv, alpha)
    print(
        f"\n{label}: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}, n = {n}, power vs TV {tv} = {power:.3f}, "
        f"acceptance = {metrics['acceptance_rate']:.3f}"
    )
    assert acceptance[0] < metrics["acceptance_rate"] < acceptance[1]
    assert dof >= 2 and power >= design_power, "too many cells for the sample size: raise n"
    assert p >= alpha, (
        f"{label}: the emitted law differs from the processed target law (p = {p:.2e})"
    )
