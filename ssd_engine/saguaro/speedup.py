"""Theorem 7: SSD's expected speedup over autoregressive decoding. With the hit/miss chain's
stationary hit rate p_hit = p_b / (1 - p_p + p_b):
    speedup_vs_AR = [p_hit E_p + (1 - p_hit) E_b] / [p_hit max(1, T_p) + (1 - p_hit)(1 + T_b)]
and SD with a draft costing T_SD per round: E_SD / (1 + T_SD)."""


def stationary_hit_rate(p_after_primary: float, p_after_backup: float) -> float:
    """P(hit) in the long run, from P(hit | last speculation was the primary's / the backup's)."""
    denominator = 1 - p_after_primary + p_after_backup
    return 1.0 if denominator <= 0 else p_after_backup / denominator


def ssd_speedup(p_hit: float, e_p: float, e_b: float, t_p: float, t_b: float) -> float:
    """Theorem 7's expected speedup over AR (times are relative to one target verification)."""
    tokens = p_hit * e_p + (1 - p_hit) * e_b
    time = p_hit * max(1.0, t_p) + (1 - p_hit) * (1 + t_b)
    return tokens / time


def sd_speedup(e_sd: float, t_sd: float) -> float:
    return e_sd / (1 + t_sd)
