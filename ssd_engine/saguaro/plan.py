"""Engine config + calibrations -> the SSD round's fan-outs (per temperature) and fallback."""

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from ssd_engine.core.speculative_config import SpeculativeConfig, SSDConfig
from ssd_engine.saguaro import calibration as cal_mod
from ssd_engine.saguaro.calibration import Calibration, find_calibrations
from ssd_engine.saguaro.fallback import Estimates, FallbackPolicy
from ssd_engine.saguaro.fanout import (
    fanout_for_outcomes,
    geometric_fanout,
    scale_fanout,
    uniform_fanout,
)

log = logging.getLogger("ssd_engine")


@dataclass
class SaguaroPlan:
    fanouts: list  # [(temperature, [F_0..F_K])]
    # [(temperature, [F at budget 1, ..., F at the planned budget])]: for builds cut to b rows
    fanout_tables: list
    policy: FallbackPolicy
    calibrations: list[Calibration]

    def describe(self) -> dict:
        return {
            "fanouts": {f"T={t:g}": f for t, f in self.fanouts},
            "calibrated_temperatures": [c.temperature for c in self.calibrations],
            "critical_batch_size": self.policy.critical_batch,
            "fallback": self.policy.mode,
        }


def needs_calibration(ssd: SSDConfig) -> bool:
    """Whether this SSD leaves something to a calibration or this machine's timing: a fan-out rule,
    or an auto fallback whose b* is not pinned."""
    return ssd.fanout_counts is None or (ssd.fallback == "auto" and ssd.critical_batch is None)


def plan_saguaro(
    speculative: SpeculativeConfig,
    target_path: str,
    draft_path: str,
    timing: tuple[float, float] | None = None,
) -> SaguaroPlan:
    """`timing`: predicted (T_p, T_slow), preferred to the calibration's."""
    k, ssd = speculative.k, speculative.ssd
    directory = Path(ssd.calibration_dir) if ssd.calibration_dir else cal_mod.CONFIG_DIR
    calibrations = find_calibrations(target_path, draft_path, directory)
    if calibrations:
        log.info(
            "Saguaro: using calibration(s) for this pair from %s at T = %s",
            directory,
            ", ".join(f"{c.temperature:g}" for c in calibrations),
        )
    elif needs_calibration(ssd):
        log.warning(
            "Saguaro: no calibration for this model pair in %s; using the documented defaults "
            "(alpha %.1f, r %.1f, budget B = K+1, T_p %.1f). Run `python -m ssd_engine.calibrate` for better "
            "fan-outs and fallback choices.",
            directory,
            cal_mod.DEFAULT_ALPHA,
            cal_mod.DEFAULT_R,
            cal_mod.DEFAULT_T_P,
        )
    entries = calibrations or [None]
    fanouts = [(c.temperature if c else 0.0, _fanout(ssd, c, k)) for c in entries]
    tables = [
        (t, [_fanout(ssd, c, k, b) for b in range(1, sum(f) + 1)] or [f])
        for (t, f), c in zip(fanouts, entries)
    ]
    prior = _prior(calibrations, k)
    if timing is not None:
        prior = replace(prior, t_p=timing[0], t_slow=timing[1])
    policy = FallbackPolicy(ssd.fallback, prior, ssd.critical_batch)
    return SaguaroPlan(fanouts, tables, policy, calibrations)


def _fanout(
    ssd: SSDConfig, cal: Calibration | None, k: int, budget: int | None = None
) -> list[int]:
    """The fan-out at the planned budget, or at `budget`: each rule's own optimum there (scaling the
    planned integers cannot tell which of two single branches is likelier); a user's, scaled."""
    planned = ssd.budget if ssd.budget is not None else (cal.budget if cal else k + 1)
    if ssd.fanout_counts is not None:
        counts = list(ssd.fanout_counts)
        return counts if budget is None else scale_fanout(counts, budget)
    budget = planned if budget is None else budget
    if ssd.fanout_rule == "uniform":
        return uniform_fanout(budget, k)
    if cal is None:
        return geometric_fanout(cal_mod.DEFAULT_ALPHA, cal_mod.DEFAULT_R, budget, k)
    if ssd.fanout_rule == "auto" and len(cal.outcome_probs) == k + 1:
        return fanout_for_outcomes(cal.outcome_probs, cal.r, budget)
    return geometric_fanout(cal.alpha, cal.r, budget, k)


def _prior(calibrations: list[Calibration], k: int) -> Estimates:
    if calibrations:
        c = calibrations[
            0
        ]  # the lowest temperature's; running estimates take over as rounds accrue
        return Estimates(c.p_hit, c.e_primary, c.e_fast, c.t_p, c.t_slow)
    a = cal_mod.DEFAULT_ALPHA
    return Estimates(
        cal_mod.DEFAULT_P_HIT,
        (1 - a ** (k + 1)) / (1 - a),
        cal_mod.DEFAULT_E_FAST,
        cal_mod.DEFAULT_T_P,
    )
