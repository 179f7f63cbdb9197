"""Goodness-of-fit helper shared by the sampler and verifier tests.

Chi-square test of observed counts against probabilities; cells with expected count < 5 are pooled
(growing the pooled cell with the smallest big cells until it reaches 5). The p-value is the
chi-square survival function, computed as gammaincc(dof / 2, stat / 2).
"""
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
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, dof, p_value
