"""`Synthetic`: the benchmarking hook's draft acceptance and SSD hit rates, and their checks."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Synthetic:
    """Benchmarking only (outputs are then NOT the target's): each draft token accepted with probability
    `acceptance`, each SSD speculation-cache lookup a hit with probability `hit` (sampling/synthetic.py)."""

    acceptance: float | None = None
    hit: float | None = None

    def check(self, mode: str) -> None:
        """A ValueError naming the first rate outside [0, 1], or set in a mode that never draws it."""
        for name in ("acceptance", "hit"):
            value = getattr(self, name)
            if not (
                value is None
                or (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and 0 <= value <= 1
                )
            ):
                raise ValueError(f"synthetic {name} must be in [0, 1], got {value!r}")
        if not (self.acceptance is None or mode != "ar"):
            raise ValueError(
                "synthetic acceptance decides draft tokens: it needs speculative_mode sd, ssd or "
                "auto, not ar"
            )
        if not (self.hit is None or mode in ("ssd", "auto")):
            raise ValueError(
                f"synthetic hit decides SSD cache lookups: it needs speculative_mode ssd (or auto), "
                f"not {mode}"
            )
