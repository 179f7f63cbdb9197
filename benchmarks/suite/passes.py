"""`--passes N`: run the mode list N times, alternating its order (A B C, C B A, ...), and merge.

A shared VM's memory bandwidth drifts by tens of percent over the minutes one mode takes, so two
modes measured one after the other differ by the drift as well as by themselves. In the ABBA order
every mode's passes straddle the same span of time: a linear drift cancels from the mean, and the
per-pass figures kept next to it show how much the machine moved.
"""

# counts that add up over passes; every other number is a per-pass figure and is averaged
ADDITIVE = {"requests", "tokens", "wall_s", "rounds", "drafted", "accepted"}


def order(modes: list[str], pass_index: int) -> list[str]:
    return list(modes) if pass_index % 2 == 0 else list(reversed(modes))


def merge(per_pass: list[dict]) -> dict:
    """One mode's results from each pass -> one result: cells matched by (prompt set, batch, K)."""
    first = per_pass[0]
    if len(per_pass) == 1:
        return first
    rows = []
    for row in first["rows"]:
        key = _key(row)
        same = [next(r for r in result["rows"] if _key(r) == key) for result in per_pass]
        merged = _merge_values(same)
        merged["e2e_tok_s"] = merged["tokens"] / merged["wall_s"] if merged.get("wall_s") else 0.0
        if merged.get("drafted"):
            merged["acceptance_rate"] = merged["accepted"] / merged["drafted"]
        if merged.get("rounds"):
            merged["mean_acceptance_length"] = 1 + merged["accepted"] / merged["rounds"]
        merged["decode_tok_s_by_pass"] = [r["decode_tok_s"] for r in same]
        merged["passes"] = len(same)
        rows.append(merged)
    peaks = {}
    for result in per_pass:
        for name, gb in result.get("peaks", {}).items():
            peaks[name] = max(peaks.get(name, 0.0), gb)
    return {**first, "rows": rows, "peaks": peaks}


def _key(row: dict) -> tuple:
    return row.get("set"), row.get("batch"), row.get("k")


def _merge_values(values: list):
    """Numbers: summed if additive (by key, see _merge_dicts), else averaged; dicts: key by key;
    anything else (outputs, names): the first pass's."""
    head = values[0]
    if isinstance(head, dict):
        return _merge_dicts(values)
    if all(v == head for v in values):
        return head  # settings (K, batch) and anything the passes agree on keep their type
    if (
        isinstance(head, (int, float))
        and not isinstance(head, bool)
        and all(isinstance(v, (int, float)) for v in values)
    ):
        return sum(values) / len(values)
    return head


def _merge_dicts(dicts: list[dict]) -> dict:
    out = {}
    for name, value in dicts[0].items():
        values = [d.get(name, value) for d in dicts]
        if name in ADDITIVE and all(isinstance(v, (int, float)) for v in values):
            out[name] = sum(values)
        else:
            out[name] = _merge_values(values)
    return out
