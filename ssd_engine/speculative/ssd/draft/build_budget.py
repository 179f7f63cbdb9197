"""Keep the draft's cache build inside the target's verification (T_p <= 1), at run time.

The planned fan-out's budget B comes from costs predicted before the run (planning/, or the
pair's calibration). The real window moves with contention for memory bandwidth, prompt length
and batch size, and a build that outlasts it makes the target wait on every hit (Theorem 7's
max(1, T_p)). So after each round the draft compares the build it just finished with the
verification it overlapped (the coordinator measures that window and sends it in the next
request) and caps the next build's branch rows:

- over the window: cut the rows in proportion to the branch time that must go (a branch step's
  cost grows at most linearly in its rows, so the cut is enough or errs toward too small);
- under it with room for one more row's K steps at the measured mean cost per row: add one row,
  up to the plan.

Rows are shared out over the sequences in proportion to their planned budgets, and each
sequence takes the plan's own fan-out at its share (saguaro/plan.py `fanout_tables`: Theorem 12
at that budget keeps the likeliest outcomes' branches, where shrinking the planned integers could
keep a branch on an unlikely k and drop the likeliest), or without a table its planned fan-out
scaled down keeping its shape (saguaro/fanout.py `scale_fanout`). Exactness
does not depend on any of this: every speculation is verified against the q rows it was drawn from.
"""
from dataclasses import dataclass

from ssd_engine.saguaro.fanout import scale_fanout

# aim a little under the window: the window itself jitters from round to round
HEADROOM = 0.95


@dataclass
class BuildBudget:
    cap: int | None = None    # branch rows the next build may decode over all sequences (None: the plan)

    def fanouts(self, planned: list[list[int]], tables: list[list] | None = None) -> list[list[int]]:
        """Each sequence's fan-out for the next build, from its planned one, within the cap: its
        table's entry at its share of the cap (the plan's own fan-out at that budget), else the
        planned one scaled down."""
        total = sum(map(sum, planned))
        if self.cap is None or self.cap >= total:
            return [list(p) for p in planned]
        tables = tables or [[] for _ in planned]
        out = []
        for p, table in zip(planned, tables):
            share = max(min(1, sum(p)), self.cap * sum(p) // total)
            out.append(list(table[share - 1]) if 0 < share <= len(table) else scale_fanout(p, share))
        return out

    def update(self, window_s: float, build_s: float, glue_s: float, rows: int, planned_rows: int) -> None:
        """After a build of `rows` branch rows that took `build_s` (`glue_s` of it the glue
        forward) while the target verified for `window_s`."""
        if window_s <= 0 or rows <= 0:
            return  # no verification overlapped it, or nothing was branched: nothing learnt
        target, branch_s = HEADROOM * window_s, max(build_s - glue_s, 1e-9)
        if build_s > target:
            fits = int(rows * max(target - glue_s, 0.0) / branch_s)
            self.cap = max(1, min(rows - 1, fits))
        elif build_s + branch_s / rows <= target and rows < planned_rows:
            self.cap = rows + 1
        if self.cap is not None and self.cap >= planned_rows:
            self.cap = None
