"""cpu_cores text <-> core sets: one set of CPU cores per rank (then the SSD draft's)."""


def parse_core_sets(cpu_cores: str) -> list[list[int]]:
    """'0-3;4-7' or '0,2;1,3' -> [[0, 1, 2, 3], [4, 5, 6, 7]] (one set per rank, ';'-separated)."""
    sets = []
    for part in cpu_cores.split(";"):
        cores = []
        for item in filter(None, (p.strip() for p in part.split(","))):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
                raise ValueError(
                    f"cpu_cores: cannot read {item!r} in {cpu_cores!r}; write core sets like '0-3;4-7' or '0,2;1'"
                )
            cores.extend(range(int(lo), int(hi or lo) + 1))
        if not cores:
            raise ValueError(f"cpu_cores: empty core set in {cpu_cores!r}")
        sets.append(sorted(set(cores)))
    return sets


def format_core_sets(sets: list[list[int]]) -> str:
    """[[0, 1], [2]] -> '0,1;2': the cpu_cores text parse_core_sets reads back."""
    return ";".join(",".join(map(str, cores)) for cores in sets)
