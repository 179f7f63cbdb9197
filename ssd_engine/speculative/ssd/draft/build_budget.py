"""Keep the draft's cache build inside the target's verification (T_p <= 1) at run time: a build
that outlasts it makes the target wait on every hit. The next build's branch rows are cut in
proportion to the branch time over the window (a step's cost grows at most linearly in its rows), or
grow by one when there is room, up to the plan. Exactness never depends on this."""

from dataclasses import dataclass

from ssd_engine.saguaro.fanout import scale_fanout

HEADROOM = 0.95  # the window jitters from round to round


@dataclass
class BuildBudget:
    cap: int | None = None  # branch rows the next build may decode in all (None: the plan)

    def fanouts(
        self, planned: list[list[int]], tables: list[list] | None = None
    ) -> list[list[int]]:
        """Each sequence's fan-out for the next build: with a cap, its table's entry at its share
        of the cap (shares proportional to planned budgets), else its planned one scaled down."""
        total = sum(map(sum, planned))
        if self.cap is None or self.cap >= total:
            return [list(p) for p in planned]
        tables = tables or [[] for _ in planned]
        out = []
        for p, table in zip(planned, tables):
            share = max(min(1, sum(p)), self.cap * sum(p) // total)
            out.append(
                list(table[share - 1]) if 0 < share <= len(table) else scale_fanout(p, share)
            )
        return out

    def update(
        self, window_s: float, build_s: float, glue_s: float, rows: int, planned_rows: int
    ) -> None:
        """After a build of `rows` branch rows that took `build_s` (`glue_s` of it the glue
        forward) while the target verified for `window_s`."""
        if window_s <= 0 or rows <= 0:
            return
        target, branch_s = HEADROOM * window_s, max(build_s - glue_s, 1e-9)
        if build_s > target:
            fits = int(rows * max(target - glue_s, 0.0) / branch_s)
            self.cap = max(1, min(rows - 1, fits))
        elif build_s + branch_s / rows <= target and rows < planned_rows:
            self.cap = rows + 1
        if self.cap is not None and self.cap >= planned_rows:
            self.cap = None
