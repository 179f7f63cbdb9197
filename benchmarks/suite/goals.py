"""The ratios the engine is judged by, in one compact table: each mode at its best K, decode tok/s
averaged over the prompt sets, one column per batch size. A ratio is listed only when its modes
ran; `auto` is also set against the best fixed mode on the same cores, and its choice is named.
SD's round efficiency (measured tok/s over what its acceptance and forward costs predict) closes
the table: how much of a round goes outside the forwards."""

from suite.report import best_k, round_efficiency, rows_of

# (numerator, denominators: the fastest of those that ran, what the ratio says)
GOALS = (
    ("sd", ("ar",), "speculation on the target's cores"),
    ("ssd", ("ar",), "the paper's SSD speedup (SSD adds the draft's cores)"),
    ("ssd", ("sd",), "the paper's SSD over SD"),
    ("ssd", ("ar-all",), "SSD vs AR on the same cores"),
    ("auto", ("ar-all",), "auto vs AR on the same cores"),
    (
        "auto",
        ("ar-all", "sd-all", "ssd"),
        "auto vs the best fixed mode on the same cores (1.00x: it picked right)",
    ),
    ("sd", ("hf-assisted",), "our SD vs transformers' assisted generation"),
)


def mean_tok_s(raw: dict, mode: str, batch: int) -> float | None:
    """Decode tok/s at the mode's best K, averaged over the prompt sets (None: a set not measured)."""
    k = best_k(raw, mode, batch)
    hits = [rows_of(raw, mode, batch=batch, set=name, k=k) for name in raw["prompt_sets"]]
    if not hits or not all(hits):
        return None
    return sum(hit[0]["decode_tok_s"] for hit in hits) / len(hits)


def ratio_cell(raw: dict, top: str, bottoms: tuple[str, ...], batch: int) -> str:
    """`top` over the fastest of `bottoms` at one batch size, naming that one when there is a choice."""
    num = mean_tok_s(raw, top, batch)
    dens = {mode: v for mode in bottoms if (v := mean_tok_s(raw, mode, batch))}
    if num is None or not dens:
        return "n/a"
    best = max(dens, key=dens.get)
    return f"{num / dens[best]:.2f}x" + (f" ({best})" if len(bottoms) > 1 else "")


def efficiency_cell(raw: dict, mode: str, batch: int) -> str:
    """SD's round efficiency (report.round_efficiency) at its best K, averaged over the prompt sets."""
    k = best_k(raw, mode, batch)
    found = [round_efficiency(raw, row) for row in rows_of(raw, mode, batch=batch, k=k)]
    if not found or None in found:
        return "n/a"
    return f"{sum(e['efficiency'] for e in found) / len(found):.2f}"


def _label(top: str, ran: list[str], bottoms: tuple[str, ...]) -> str:
    name = {"ar": "AR", "sd": "SD", "ssd": "SSD"}
    if len(bottoms) == 1:
        return f"{name.get(top, top)} / {name.get(bottoms[0], bottoms[0])}"
    return f"{top} / best of ({', '.join(ran)})"


def goal_lines(raw: dict) -> list[str]:
    results = raw["results"]
    lines = []
    for top, bottoms, meaning in GOALS:
        ran = [mode for mode in bottoms if mode in results]
        if top not in results or not ran:
            continue
        cells = " | ".join(ratio_cell(raw, top, tuple(ran), batch) for batch in raw["batch"])
        lines.append(f"| {_label(top, ran, bottoms)} | {meaning} | {cells} |")
    if "sd" in results:
        cells = " | ".join(efficiency_cell(raw, "sd", batch) for batch in raw["batch"])
        lines.append(
            f"| SD round efficiency | measured SD tok/s / (E / (K t_draft + t_verify)), the run's own "
            f"acceptance and forward costs (goal >= 0.9; batch 1 only) | {cells} |"
        )
    if not lines:
        return []
    head = [
        "| ratio | what it says | " + " | ".join(f"batch {b}" for b in raw["batch"]) + " |",
        "|---|---|" + "---|" * len(raw["batch"]),
    ]
    return head + lines + [""] + auto_lines(raw)


def auto_lines(raw: dict) -> list[str]:
    """What `auto` ran, what it predicted for each mode, and what the chosen mode measured."""
    result = raw["results"].get("auto")
    if not result or not result.get("rows"):
        return []
    row = result["rows"][0]
    ran = row.get("chosen_mode")
    lines = [
        f"auto ran {ran or 'an unreported mode'}"
        + (f" at K = {row['chosen_k']}" if row.get("chosen_k") else "")
        + (f": {result['mode_choice']}" if result.get("mode_choice") else ".")
    ]
    predicted = (row.get("predicted_tok_s") or {}).get(ran)
    measured = [
        f"{v:.2f} at batch {b}"
        for b in raw["batch"]
        if (v := mean_tok_s(raw, "auto", b)) is not None
    ]
    # the prediction's batch is the engine's business: no ratio, both numbers
    if predicted and measured:
        lines.append(f"Predicted {predicted:.2f} tok/s for {ran}; measured {', '.join(measured)}.")
    return lines + [""]
