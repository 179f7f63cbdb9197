"""Calibrated Saguaro parameters for one (target, draft, temperature), stored as JSON in configs/
and matched by the model pair's fingerprints (not paths) and each request's temperature."""

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ssd_engine.saguaro.fanout import expected_hit_rate, fanout_for_outcomes, geometric_fanout

log = logging.getLogger("ssd_engine")

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# documented defaults for an uncalibrated pair (docs/saguaro.md "Saguaro options")
DEFAULT_ALPHA, DEFAULT_R, DEFAULT_T_P, DEFAULT_E_FAST, DEFAULT_P_HIT = 0.7, 1.0, 1.0, 1.0, 0.7


@dataclass
class Calibration:
    target: str  # fingerprints (model_fingerprint) of the pair
    draft: str
    temperature: float
    k: int
    alpha: float  # per-token acceptance of the primary
    outcome_probs: list[float]  # measured P(k accepted), k = 0..K
    r: float  # miss(F) ≈ miss_coeff * F^(-r)
    miss_coeff: float
    miss_by_fanout: list[float]  # measured miss rate at F = 1, 2, ...
    budget: int  # B: branches per sequence (best_budget)
    budget_fits: int  # the most branches whose build fits inside one verification (>= 1)
    t_p: float  # draft cache build (at B) / verification
    e_primary: float  # tokens committed per round, primary speculation
    e_fast: float  # tokens committed per round, fast backup speculation
    p_hit: float  # hit rate expected at the geometric fan-out with budget B
    t_slow: float | None = None  # just-in-time drafting on a miss / verification (None: assume T_p)
    timings: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)

    def save(self, directory: Path = CONFIG_DIR) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"{self.measured.get('target_name', self.target)}--{self.measured.get('draft_name', self.draft)}"
        path = directory / f"saguaro-{_slug(name)}-T{self.temperature:g}.json"
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        return cls(**json.loads(Path(path).read_text()))


# config.json keys that record how a folder was written, not which model it holds
UNIDENTIFYING_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")


def model_fingerprint(model_path: str) -> str:
    """A checkpoint's identity wherever stored: config.json (less bookkeeping), weight files' names,
    sizes and 64 KiB from the middle of each (so fine-tunes of one architecture differ)."""
    folder = Path(model_path)
    config = json.loads((folder / "config.json").read_text())
    identity = {key: value for key, value in config.items() if key not in UNIDENTIFYING_KEYS}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for weights in sorted(folder.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            f.seek(size // 2)
            digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]


def find_calibrations(
    target_path: str, draft_path: str, directory: Path = CONFIG_DIR
) -> list[Calibration]:
    """Every stored calibration of this pair (any temperature), lowest temperature first."""
    target, draft = model_fingerprint(target_path), model_fingerprint(draft_path)
    found = []
    for path in sorted(Path(directory).glob("saguaro-*.json")):
        try:
            cal = Calibration.load(path)
        except (TypeError, ValueError) as error:
            log.warning("ignoring unreadable calibration %s: %s", path, error)
            continue
        if cal.target == target and cal.draft == draft:
            found.append(cal)
    return sorted(found, key=lambda c: c.temperature)


def miss_curve(rank_counts: list[int]) -> list[float]:
    """rank_counts[j]: bonuses at the draft's (j+1)-th candidate (last: deeper) -> P(rank >= F)."""
    total = sum(rank_counts)
    if total == 0:
        return []
    beyond, misses = [], total
    for count in rank_counts[:-1]:
        misses -= count
        beyond.append(misses / total)
    return beyond


def fit_power_law(miss_by_fanout: list[float]) -> tuple[float, float]:
    """Least squares on log miss = log c - r log F over the F with miss > 0 -> (r, c)."""
    points = [(math.log(f), math.log(m)) for f, m in enumerate(miss_by_fanout, start=1) if m > 0]
    if len(points) < 2:
        return DEFAULT_R, 1.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    r = max(-slope, 1e-3)  # a miss rate that does not fall with F: nearly uniform fan-out
    return r, math.exp(my + r * mx)


def best_budget(
    verify_s: float,
    glue_s: float,
    step_s,
    k: int,
    alpha,
    r: float,
    miss_at,
    miss_cost_s: float,
    limit: int = 64,
) -> int:
    """B minimising the expected round time max(verify, glue + K step(B)) + (1 - hit(B)) * miss cost,
    with hit(B) the geometric fan-out's expected hit rate."""

    def round_time(b: int) -> float:  # alpha: a rate (Theorem 12's fan-out) or a measured P(k)
        fan = (
            geometric_fanout(alpha, r, b, k)
            if isinstance(alpha, float)
            else fanout_for_outcomes(alpha, r, b)
        )
        hit = expected_hit_rate(fan, alpha, miss_at)
        return max(verify_s, glue_s + k * step_s(b)) + (1 - hit) * miss_cost_s

    return min(range(1, limit + 1), key=lambda b: (round(round_time(b), 9), b))


def budget_from_timings(verify_s: float, glue_s: float, step_s, k: int, limit: int = 64) -> int:
    """B = the most branches whose glue + K decode steps end within one verification; at least 1."""
    best = 1
    for b in range(1, limit + 1):
        if glue_s + k * step_s(b) <= verify_s:
            best = b
    return best


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)
