"""bench_synthetic.py's cells next to the paper's predictions from the same run's measured costs.

With synthetic acceptance alpha every draft token is accepted i.i.d. with probability alpha (the
first rejection ends the round), so a round emits E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha)
tokens on average, whatever the weights. From the forward costs the AR run measured (best of
`reps`, batch b: b rows for a decode step, b (K + 1) for a verification) and the SD run's draft
step (b rows):

    SD / AR  predicted = E / (K t_draft + t_verify) * t_ar
    SSD / AR predicted = Theorem 7 (saguaro/speedup.py: p_hit, E_p = E_b = E, T_p, T_b) * t_ar / t_verify

Theorem 7 counts time in verifications; t_ar / t_verify turns that into AR steps, as the SD line
does (its 1 + T_SD is (K t_draft + t_verify) / t_verify). p_hit is the cell's measured warm hit
rate (the synthetic p, as drawn), T_p its measured draft build time / verification time, T_b its
just-in-time drafting time / verification time (0 with the fast backup), all from the same cell.

The paper takes a verification to cost the same whether or not the draft runs beside it. On a CPU
the draft process's cores share the memory bus with the target's, so SSD's verifications can run
slower than the probe's t_verify: the second SSD prediction uses the cell's own verification
round time instead (`verify_s_per_round`, contention included), SSD / AR = Theorem 7 * t_ar /
that; the gap between the two is what the shared memory bus costs.
"""

from ssd_engine.saguaro.speedup import ssd_speedup


def expected_tokens(alpha: float, k: int) -> float:
    """E(alpha, K): tokens per round, accepted drafts plus the one after them."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_acceptance_rate(alpha: float, k: int) -> float:
    """accepted / drafted: E[accepted] / K with P(accepted >= j) = alpha^j."""
    return sum(alpha**j for j in range(1, k + 1)) / k


def _cost(forward: dict, n: int) -> float | None:
    return forward.get(n, forward.get(str(n)))


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def predict_sd(alpha: float, k: int, t_ar: float, t_verify: float, t_draft: float) -> float:
    return expected_tokens(alpha, k) / (k * t_draft + t_verify) * t_ar


def predict_ssd(alpha: float, k: int, t_ar: float, t_verify: float, ssd: dict) -> float | None:
    """Theorem 7 in AR steps from one SSD cell's counters (None without a timed verification)."""
    verify = ssd.get("verify_s_per_round")
    if not verify:
        return None
    t_b = (ssd.get("jit_s_per_round") or 0.0) / verify
    e = expected_tokens(alpha, k)
    return ssd_speedup(ssd["cache_hit_rate_warm"], e, e, ssd["T_p"], t_b) * t_ar / t_verify


def predict_ssd_own_verify(alpha: float, k: int, t_ar: float, ssd: dict) -> float | None:
    """Theorem 7 in AR steps with the cell's own verification time (what the draft beside it costs)."""
    verify = ssd.get("verify_s_per_round")
    return predict_ssd(alpha, k, t_ar, verify, ssd) if verify else None


def cells(sweep: dict) -> list[dict]:
    """One line per SD / SSD cell: measured and predicted speedup over AR at the same batch size."""
    ar_costs = sweep["ar"]["costs"]["target_forward_s"]
    ar_tok_s = {r["batch"]: r["decode_tok_s"] for r in sweep["ar"]["rows"]}
    lines = []
    for run in sweep["runs"]:
        alpha = run["alpha"]
        draft_costs = run.get("draft_forward_s") or {}
        for r in run["rows"]:
            b, k = r["batch"], r["k"]
            t_ar, t_verify = _cost(ar_costs, b), _cost(ar_costs, b * (k + 1))
            own_verify = None
            if run["mode"] == "sd":
                t_draft = _cost(draft_costs, b)
                predicted = predict_sd(alpha, k, t_ar, t_verify, t_draft) if t_draft else None
            else:
                predicted = predict_ssd(alpha, k, t_ar, t_verify, r["ssd"])
                own_verify = predict_ssd_own_verify(alpha, k, t_ar, r["ssd"])
            measured = _ratio(r["decode_tok_s"], ar_tok_s.get(b))
            ssd = r.get("ssd") or {}
            lines.append(
                {
                    "mode": run["mode"],
                    "alpha": alpha,
                    "k": k,
                    "batch": b,
                    "budget": run.get("budget"),
                    "hit": run.get("hit"),
                    "decode_tok_s": r["decode_tok_s"],
                    "ar_tok_s": ar_tok_s.get(b),
                    "measured": measured,
                    "predicted": predicted,
                    "ratio": _ratio(measured, predicted),
                    "predicted_own_verify": own_verify,
                    "ratio_own_verify": _ratio(measured, own_verify),
                    "verify_ms": 1e3 * ssd["verify_s_per_round"]
                    if ssd.get("verify_s_per_round")
                    else None,
                    "t_verify_ms": 1e3 * t_verify,
                    "acceptance": r.get("acceptance_rate"),
                    "expected_acceptance": expected_acceptance_rate(alpha, k),
                    "hit_rate": ssd.get("cache_hit_rate_warm"),
                    "T_p": ssd.get("T_p"),
                    "T_b": _ratio(ssd.get("jit_s_per_round"), ssd.get("verify_s_per_round")),
                    "draft_format": r.get("draft_format"),
                }
            )
    return lines


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _own_verify(c: dict) -> str:
    if c["predicted_own_verify"] is None:
        return "-"
    return f"{c['predicted_own_verify']:.2f}x ({_fmt(c['ratio_own_verify'])})"


def markdown(sweep: dict, lines: list[dict]) -> str:
    ar_costs = sweep["ar"]["costs"]["target_forward_s"]
    out = [
        f"# Synthetic-acceptance sweep, {sweep['date']}",
        "",
        f"- Machine: {sweep['machine']}",
        f"- Placement: {sweep['placement']}",
        f"- Target: `{sweep['target']}`, draft: `{sweep['draft']}`, load_format dummy (random weights)",
        f"- Command: `{sweep['command']}`",
        f"- Settings: {sweep['num_prompts']} random-id prompts of {sweep['prompt_len']} tokens, "
        f"{sweep['new_tokens']} new tokens each, greedy, SSD fallback {sweep['fallback']}; "
        "**acceptance and SSD hits are drawn (synthetic_acceptance, synthetic_hit): outputs are not the "
        "target's, only the speed is**",
        "",
        "Measured = decode tok/s over AR's at the same batch size. Predicted: SD = E / (K t_draft + t_verify) "
        "* t_ar with E = (1 - alpha^(K+1)) / (1 - alpha); SSD = Theorem 7 with this cell's measured hit rate, "
        "T_p and T_b, E_p = E_b = E, times t_ar / t_verify (benchmarks/suite/synthetic_report.py). "
        "SSD's second prediction replaces the probe's t_verify by the cell's own verification round (the "
        "draft process beside the target shares its memory bus); verify ms: probe / SSD's own.",
        "",
        "| mode | alpha | K | batch | B | p | tok/s | AR tok/s | measured x AR | predicted x AR "
        "| measured / predicted | SSD: predicted with own verify (measured / it) | verify ms "
        "| acceptance (expected) | hit rate | T_p | T_b | draft |",
        "|---" * 18 + "|",
    ]
    for c in lines:
        out.append(
            f"| {c['mode']} | {c['alpha']} | {c['k']} | {c['batch']} | {_fmt(c['budget'], 'd')} "
            f"| {_fmt(c['hit'], '.2f')} | {c['decode_tok_s']:.2f} | {_fmt(c['ar_tok_s'])} "
            f"| {_fmt(c['measured'], '.2f', 'x')} | {_fmt(c['predicted'], '.2f', 'x')} | {_fmt(c['ratio'])} "
            f"| {_own_verify(c)} | {c['t_verify_ms']:.0f}{' / ' + _fmt(c['verify_ms'], '.0f') if c['verify_ms'] else ''} "
            f"| {_fmt(c['acceptance'], '.3f')} ({c['expected_acceptance']:.3f}) | {_fmt(c['hit_rate'], '.3f')} "
            f"| {_fmt(c['T_p'])} | {_fmt(c['T_b'])} | {c['draft_format'] or '-'} |"
        )
    rows = sorted(map(int, ar_costs))
    out += [
        "",
        f"Forward costs measured in this run (best of {sweep['reps']} forwards of n new rows after a "
        f"{sweep['prefix']}-token prefix), in ms:",
        "",
        "| n rows | " + " | ".join(map(str, rows)) + " |",
        "|---" * (len(rows) + 1) + "|",
        "| target (AR run) | " + " | ".join(f"{_cost(ar_costs, n) * 1e3:.1f}" for n in rows) + " |",
        "",
    ]
    for run in sweep["runs"]:
        if run["mode"] == "sd" and run.get("draft_forward_s"):
            draft = run["draft_forward_s"]
            out.append(
                f"- draft in SD's format, alpha {run['alpha']} run: "
                + ", ".join(
                    f"{n} rows {_cost(draft, n) * 1e3:.1f}" for n in sorted(map(int, draft))
                )
            )
    return "\n".join(out) + "\n"


def plot(sweep: dict, lines: list[dict], path: str) -> str:
    """Left: speedup over AR against alpha, measured (solid) and predicted (dashed), per mode and K
    at the first batch size, budget and hit rate; right: every cell's measured against predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    first = lambda key: next((c[key] for c in lines if c[key] is not None), None)
    batch, budget, hit = first("batch"), first("budget"), first("hit")
    styles = {"sd": ("tab:orange", "o"), "ssd": ("tab:green", "s")}
    for mode, k in sorted({(c["mode"], c["k"]) for c in lines}):
        chosen = sorted(
            (
                c
                for c in lines
                if c["mode"] == mode
                and c["k"] == k
                and c["batch"] == batch
                and (mode == "sd" or (c["budget"] == budget and c["hit"] == hit))
            ),
            key=lambda c: c["alpha"],
        )
        color, marker = styles[mode]
        alphas = [c["alpha"] for c in chosen]
        left.plot(
            alphas,
            [c["measured"] for c in chosen],
            marker=marker,
            color=color,
            alpha=0.5 + 0.5 * k / 8,
            label=f"{mode.upper()} K={k} measured",
        )
        left.plot(
            alphas,
            [c["predicted"] for c in chosen],
            marker=marker,
            color=color,
            linestyle="--",
            fillstyle="none",
            alpha=0.5 + 0.5 * k / 8,
            label=f"{mode.upper()} K={k} predicted",
        )
        if mode == "ssd":
            left.plot(
                alphas,
                [c["predicted_own_verify"] for c in chosen],
                marker="^",
                color=color,
                linestyle=":",
                fillstyle="none",
                alpha=0.5 + 0.5 * k / 8,
                label=f"SSD K={k} predicted, own verify",
            )
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set_xlabel("synthetic acceptance alpha")
    left.set_ylabel(f"speedup over AR (batch {batch})")
    left.set_title(f"SSD at B = {budget}, p = {hit}", fontsize=9)
    left.legend(fontsize=7)
    pairs = [
        (c["predicted"], c["measured"], c["mode"])
        for c in lines
        if c["predicted"] and c["measured"]
    ]
    for mode, (color, marker) in styles.items():
        xs = [p for p, _, m in pairs if m == mode]
        right.scatter(
            xs,
            [v for _, v, m in pairs if m == mode],
            color=color,
            marker=marker,
            label=mode.upper(),
        )
    own = [
        (c["predicted_own_verify"], c["measured"])
        for c in lines
        if c["predicted_own_verify"] and c["measured"]
    ]
    right.scatter(
        [p for p, _ in own],
        [v for _, v in own],
        color=styles["ssd"][0],
        marker="^",
        facecolors="none",
        label="SSD, own verify",
    )
    top = max([max(p, v) for p, v, _ in pairs] + [max(p, v) for p, v in own] or [1.0]) * 1.1
    right.plot([0, top], [0, top], color="gray", linewidth=0.8, linestyle=":")
    right.set_xlim(0, top)
    right.set_ylim(0, top)
    right.set_xlabel("predicted speedup over AR")
    right.set_ylabel("measured speedup over AR")
    right.set_title("every cell (dotted: measured = predicted)", fontsize=9)
    right.legend(fontsize=8)
    fig.suptitle(
        f"Synthetic acceptance, {sweep['date']}: {sweep['target']} / {sweep['draft']}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
