"""The Markdown report of one bench.py run: headline in the paper's column order (Appendix B.3),
per-set details, SSD next to Theorem 7 and Corollary 9, a per-round profile of each side, memory."""

REFERENCE = {
    "ar": None,
    "ar-all": "ar",
    "sd": "ar",
    "sd-all": "ar",
    "ssd": "ar",
    "auto": "ar",
    "hf-ar": "ar",
    "hf-assisted": "hf-ar",
}


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def cost(forward: dict, n: int) -> float | None:
    """A forward cost by token count; JSON turns the int keys into strings."""
    return forward.get(str(n), forward.get(n))


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def rows_of(raw: dict, mode: str, **where) -> list[dict]:
    rows = raw["results"].get(mode, {}).get("rows", [])
    return [r for r in rows if all(r[key] == value for key, value in where.items())]


def best_k(raw: dict, mode: str, batch: int) -> int | None:
    """The K with the highest decode tok/s averaged over the prompt sets (None: not measured)."""
    by_k: dict = {}
    for row in rows_of(raw, mode, batch=batch):
        by_k.setdefault(row["k"], []).append(row["decode_tok_s"])
    return max(by_k, key=lambda k: sum(by_k[k]) / len(by_k[k])) if by_k else None


def headline(raw: dict, batch: int) -> dict[str, dict[str, float | None]]:
    """set (and "average") -> {ar, sd, ssd: decode tok/s at each mode's best K}."""
    table = {}
    for name in raw["prompt_sets"]:
        table[name] = {}
        for mode in ("ar", "sd", "ssd"):
            k = best_k(raw, mode, batch)
            hit = rows_of(raw, mode, batch=batch, set=name, k=k)
            table[name][mode] = hit[0]["decode_tok_s"] if hit else None
    if len(table) > 1:
        table["average"] = {
            m: (
                sum(v[m] for v in table.values()) / len(table)
                if all(v[m] is not None for v in table.values())
                else None
            )
            for m in ("ar", "sd", "ssd")
        }
    return table


def draft_format(raw: dict, mode: str, batch: int, k: int | None) -> str | None:
    """The draft weight format a mode ran at this batch size and K (None: not recorded, e.g. an
    older result file, or no draft)."""
    return next(
        (
            r.get("draft_format")
            for r in rows_of(raw, mode, batch=batch, k=k)
            if r.get("draft_format")
        ),
        None,
    )


def _at_k(raw: dict, mode: str, batch: int) -> str:
    k = best_k(raw, mode, batch)
    fmt = draft_format(raw, mode, batch, k)
    return f"{mode.upper()} at K = {_fmt(k, 'd')}" + (f", {fmt} draft" if fmt else "")


def headline_heading(raw: dict, batch: int) -> str:
    """The batch's heading, naming the K (and draft format) of SD and SSD where each ran: a mode
    not run gets no "at K = n/a"."""
    ran = [
        _at_k(raw, mode, batch) for mode in ("sd", "ssd") if best_k(raw, mode, batch) is not None
    ]
    return (
        f"### Batch {batch} (decode tok/s, prefill excluded{''.join('; ' + part for part in ran)})"
    )


def headline_lines(raw: dict) -> list[str]:
    lines = []
    for batch in raw["batch"]:
        lines += [
            headline_heading(raw, batch),
            "",
            "| prompts | AR tok/s | SD tok/s | SSD tok/s | SSD/SD | SSD/AR |",
            "|---|---|---|---|---|---|",
        ]
        for name, v in headline(raw, batch).items():
            lines.append(
                f"| {name} | {_fmt(v['ar'])} | {_fmt(v['sd'])} | {_fmt(v['ssd'])} "
                f"| {_fmt(_ratio(v['ssd'], v['sd']), '.2f', 'x')} | {_fmt(_ratio(v['ssd'], v['ar']), '.2f', 'x')} |"
            )
        lines.append("")
    return lines


def _same_as(raw: dict, row: dict) -> str:
    ref_mode = REFERENCE.get(row["mode"])
    if ref_mode is None or raw["temperature"] > 0:
        return "-"
    ref = rows_of(raw, ref_mode, set=row["set"], batch=row["batch"]) or rows_of(
        raw, ref_mode, set=row["set"], batch=1
    )
    if not ref or "outputs" not in row:
        return "-"
    same = sum(a == b for a, b in zip(row["outputs"], ref[0]["outputs"]))
    return f"{same}/{len(row['outputs'])} {ref_mode}"


def _mode_cell(row: dict) -> str:
    """The row's mode; `auto` rows name the mode the engine chose (their K column is its K)."""
    return (
        f"auto: {row['chosen_mode']}"
        if row["mode"] == "auto" and row.get("chosen_mode")
        else row["mode"]
    )


def detail_lines(raw: dict) -> list[str]:
    lines = []
    for name in raw["prompt_sets"]:
        lines += [
            f"### {name}",
            "",
            "| mode | K | draft | batch | decode tok/s | e2e tok/s | TTFT ms | TPOT ms | latency s | acceptance "
            "| mean acc. length | hit rate | T_p | same output as |",
            "|---" * 14 + "|",
        ]
        for mode in raw["results"]:
            for r in rows_of(raw, mode, set=name):
                ssd = r.get("ssd") or {}
                lines.append(
                    f"| {_mode_cell(r)} | {r['k'] or '-'} | {r.get('draft_format') or '-'} | {r['batch']} "
                    f"| {r['decode_tok_s']:.2f} | {r['e2e_tok_s']:.2f} "
                    f"| {r['ttft_s'] * 1e3:.0f} | {_fmt(r['tpot_s'] and r['tpot_s'] * 1e3, '.0f')} | {r['latency_s']:.1f} "
                    f"| {_fmt(r.get('acceptance_rate'), '.3f') if r['k'] else '-'} "
                    f"| {_fmt(r.get('mean_acceptance_length')) if r['k'] else '-'} "
                    f"| {_fmt(ssd.get('cache_hit_rate_warm'), '.3f') if ssd else '-'} "
                    f"| {_fmt(ssd.get('T_p')) if ssd else '-'} | {_same_as(raw, r)} |"
                )
        lines.append("")
    return lines


def theorem7(m: dict) -> float | None:
    """Theorem 7's SSD/AR from one cell's SSD metrics (None when a needed number is missing)."""
    from ssd_engine.saguaro.speedup import ssd_speedup

    if not m.get("verify_s_per_round") or (
        m["cache_hit_rate_warm"] > 0 and not m.get("tokens_per_round_hit")
    ):
        return None
    t_b = (m.get("jit_s_per_round") or 0.0) / m["verify_s_per_round"]
    return ssd_speedup(
        m["cache_hit_rate_warm"],
        m["tokens_per_round_hit"],
        m.get("tokens_per_round_miss") or 1.0,
        m["T_p"],
        t_b,
    )


def corollary9(raw: dict, row: dict) -> tuple[float | None, float | None]:
    """Corollary 9's bounds on SSD/SD: (1 + T_SD)(p E_p + 1 - p) / E_SD <= SSD/SD <= (1 + T_SD) E_p / E_SD,
    T_SD = K draft steps / one verification (SD's measured costs), E_SD = SD's mean acceptance length."""
    costs = raw["results"].get("sd", {}).get("costs", {})
    sd = rows_of(raw, "sd", set=row["set"], batch=row["batch"], k=row["k"])
    m, k = row["ssd"], row["k"]
    verify = cost(costs.get("target_forward_s", {}), k + 1)
    if not sd or not verify or not costs.get("draft_step_s") or not m["acceptance_on_hits"]:
        return None, None
    t_sd, e_sd, e_p = (
        k * costs["draft_step_s"] / verify,
        sd[0]["mean_acceptance_length"],
        1 + k * m["acceptance_on_hits"],
    )
    p = m["cache_hit_rate"]
    return (1 + t_sd) * (p * e_p + 1 - p) / e_sd, (1 + t_sd) * e_p / e_sd


def ssd_lines(raw: dict) -> list[str]:
    lines = [
        "Theorem 7: predicted SSD/AR = [p E_p + (1-p) E_b] / [p max(1, T_p) + (1-p)(1 + T_b)] with this cell's "
        "warm hit rate p, tokens per hit / miss round E_p / E_b, T_p = draft build / verification time, "
        "T_b = just-in-time drafting / verification time (0 with the fast backup). Measured SSD/AR uses "
        "decode tok/s. Theorem 7 counts time in verifications and takes one to cost one AR step; c = this "
        "cell's verification round time / AR's time per token (TPOT) says what one costs here, and "
        "Thm 7 / c is the prediction in AR steps. Corollary 9 bounds SSD/SD with SD's costs and acceptance "
        "from the same run.",
        "",
        "| prompts | K | batch | SSD/AR | Thm 7 SSD/AR | c | Thm 7 / c | measured ÷ (Thm 7 / c) | p (warm) | E_p "
        "| E_b | T_p | T_b | SSD/SD | Cor. 9 lower | Cor. 9 upper | speculations | B planned -> built |",
        "|---" * 18 + "|",
    ]
    for r in rows_of(raw, "ssd"):
        m = r["ssd"]
        ar = rows_of(raw, "ar", set=r["set"], batch=r["batch"])
        sd = rows_of(raw, "sd", set=r["set"], batch=r["batch"], k=r["k"])
        vs_ar = _ratio(r["decode_tok_s"], ar[0]["decode_tok_s"]) if ar else None
        predicted = theorem7(m)
        c = _ratio(m.get("verify_s_per_round"), ar[0]["tpot_s"]) if ar else None
        in_ar_steps = _ratio(predicted, c)
        lower, upper = corollary9(raw, r)
        t_b = _ratio(m.get("jit_s_per_round"), m.get("verify_s_per_round"))
        lines.append(
            f"| {r['set']} | {r['k']} | {r['batch']} | {_fmt(vs_ar, '.2f', 'x')} | {_fmt(predicted, '.2f', 'x')} "
            f"| {_fmt(c)} | {_fmt(in_ar_steps, '.2f', 'x')} | {_fmt(_ratio(vs_ar, in_ar_steps))} | {m['cache_hit_rate_warm']:.3f} | {_fmt(m['tokens_per_round_hit'])} "
            f"| {_fmt(m['tokens_per_round_miss'])} | {m['T_p']:.2f} | {_fmt(t_b)} "
            f"| {_fmt(_ratio(r['decode_tok_s'], sd[0]['decode_tok_s']) if sd else None, '.2f', 'x')} "
            f"| {_fmt(lower, '.2f', 'x')} | {_fmt(upper, '.2f', 'x')} | {m['speculations_by_source']} "
            f"| {_budgets(m)} |"
        )
    return lines + [""]


def _budgets(m: dict) -> str:
    """The plan's budget B (per temperature) and the mean branch rows the builds ran with, which
    the draft caps to the verification window (ssd_fit_window)."""
    planned = "/".join(str(sum(f)) for f in (m.get("fanouts") or {}).values()) or "-"
    built = m.get("branch_rows_per_build")
    return f"{planned} -> {_fmt(built, '.1f')}" if built is not None else planned


def round_efficiency(raw: dict, row: dict) -> dict | None:
    """An SD row at batch 1 against the round model: predicted tok/s = E / (K t_draft + t_verify),
    E its measured mean acceptance length (tokens per round), t_draft one draft step and t_verify
    one verification of K + 1 tokens from the same run's probes; efficiency = measured decode tok/s
    / predicted (goal >= 0.9). None when a number is missing (another batch size: the probes time
    one sequence). The probes keep their best of `reps`, so the prediction leans optimistic."""
    costs = raw["results"].get(row["mode"], {}).get("costs", {})
    verify, draft = (
        cost(costs.get("target_forward_s", {}), (row["k"] or 0) + 1),
        costs.get("draft_step_s"),
    )
    e = row.get("mean_acceptance_length")
    if row["batch"] != 1 or not row["k"] or not verify or not draft or not e:
        return None
    predicted = e / (row["k"] * draft + verify)
    return {"E": e, "predicted_tok_s": predicted, "efficiency": row["decode_tok_s"] / predicted}


def efficiency_lines(raw: dict) -> list[str]:
    lines = [
        "Round efficiency: measured decode tok/s / (E / (K t_draft + t_verify)), E = the cell's mean "
        "acceptance length, t_draft and t_verify = the probes below (goal >= 0.9; below it, time goes "
        "outside the forwards: sampling, verification, bookkeeping, or forwards slower than their probes).",
        "",
        "| mode | K | prompts | E | t_draft ms | t_verify ms | predicted tok/s | measured tok/s "
        "| round efficiency |",
        "|---" * 9 + "|",
    ]
    for mode in ("sd", "sd-all"):
        costs = raw["results"].get(mode, {}).get("costs", {})
        for r in rows_of(raw, mode, batch=1):
            eff = round_efficiency(raw, r)
            if eff is None:
                continue
            lines.append(
                f"| {mode} | {r['k']} | {r['set']} | {eff['E']:.2f} | {1e3 * costs['draft_step_s']:.0f} "
                f"| {1e3 * cost(costs['target_forward_s'], r['k'] + 1):.0f} | {eff['predicted_tok_s']:.2f} "
                f"| {r['decode_tok_s']:.2f} | **{eff['efficiency']:.2f}** |"
            )
    return lines + [""] if len(lines) > 4 else []


def profile_lines(raw: dict) -> list[str]:
    """Where a round's time goes, per side, from the same run's counters and forward costs. SD's
    round is its decode time per verification round; its forwards are the probes below (best of
    `reps`: the run's forwards vary around them). SSD's sides are the coordinator's and the draft
    process's own clocks."""
    lines = [
        "| mode | K | prompts | round ms | side | phase | ms per round |",
        "|---|---|---|---|---|---|---|",
    ]
    costs = raw["results"].get("sd", {}).get("costs", {})
    for r in rows_of(raw, "sd", batch=1):
        if not r.get("rounds") or not costs.get("draft_step_s"):
            continue
        round_ms = (
            1e3 * r["tpot_s"] * (r["tokens"] - r["requests"]) / r["rounds"]
        )  # decode time, no prefill
        draft_ms = 1e3 * r["k"] * costs["draft_step_s"]
        verify_ms = 1e3 * (cost(costs["target_forward_s"], r["k"] + 1) or 0.0)
        for side, phase, ms in (
            ("draft (same process)", f"{r['k']} draft steps (probe)", draft_ms),
            ("target", f"verify forward of {r['k'] + 1} tokens (probe)", verify_ms),
            (
                "both",
                "the rest: sampling, verification, bookkeeping, and the probes' best-of vs the run's typical forward",
                round_ms - draft_ms - verify_ms,
            ),
        ):
            lines.append(
                f"| sd | {r['k']} | {r['set']} | {round_ms:.0f} | {side} | {phase} | {ms:.0f} |"
            )
    for r in rows_of(raw, "ssd", batch=1):
        m = r["ssd"]
        wait, verify = 1e3 * m["coordinator_wait_s_per_round"], 1e3 * m["verify_s_per_round"]
        build, glue = 1e3 * m["draft_build_s_per_round"], 1e3 * m["glue_s_per_round"]
        jit_rounds = sum(n for s, n in (m.get("backup_rounds") or {}).items() if s == "jit")
        for side, phase, ms in (
            ("target", "waiting for the draft's reply (send -> reply)", wait),
            ("target", "verification: forward, sampling, bookkeeping (reply -> next send)", verify),
            ("draft", "glue forward of the outcome's tokens", glue),
            ("draft", "branch decoding: K steps over all fan-out branches", build - glue),
            (
                "draft",
                f"just-in-time drafts (on {jit_rounds} backup rounds; mean over those)",
                1e3 * (m.get("jit_s_per_round") or 0.0),
            ),
        ):
            lines.append(
                f"| ssd | {r['k']} | {r['set']} | {wait + verify:.0f} | {side} | {phase} | {ms:.0f} |"
            )
    return lines + [""] if len(lines) > 2 else []


def memory_lines(raw: dict) -> list[str]:
    # the host sum is what the kernel's OOM killer weighs; processes peak at different moments, so
    # the sum of their peaks bounds the simultaneous total from above
    lines = [
        "| mode | peak memory per process (GB = 2^30 B; RSS high-water mark, GPU: allocated) "
        "| host processes summed (GB) |",
        "|---|---|---|",
    ]
    for mode, result in raw["results"].items():
        peaks = result.get("peaks", {})
        listed = ", ".join(f"{name} {gb:.2f}" for name, gb in sorted(peaks.items()))
        host = sum(gb for name, gb in peaks.items() if "GPU" not in name)
        lines.append(f"| {mode} | {listed} | {host:.2f} |")
    return lines + [""]


def costs_lines(raw: dict) -> list[str]:
    result = raw["results"].get("sd") or raw["results"].get("ar")
    forward = (result or {}).get("costs", {}).get("target_forward_s")
    if not forward:
        return []
    step = cost(forward, 1)
    draft = raw["results"].get("sd", {}).get("costs", {}).get("draft_step_s")
    lines = [
        f"Our target: one forward of n new tokens after a {raw['prefix']}-token prefix (best of {raw['reps']})"
        + (
            f"; one draft step costs {draft * 1e3:.0f} ms = {draft / step:.2f}x a target step."
            if draft
            else "."
        ),
        "",
        "| n | ms | vs n = 1 |",
        "|---|---|---|",
    ]
    lines += [
        f"| {n} | {s * 1e3:.0f} | {s / step:.2f}x |"
        for n, s in sorted(forward.items(), key=lambda x: int(x[0]))
    ]
    return lines + [""]


def _draft_setting(raw: dict) -> str:
    target = raw.get(
        "target_dtype", "fp32"
    )  # older result files: fp32, the only target format then
    # auto, fp32 and gguf keep the checkpoint's values; the others re-quantize it
    how = {"auto": "gguf for a GGUF target on CPU, else fp32", "gguf": "the GGUF's own blocks"}.get(
        target, "re-quantized"
    )
    retargeted = f", target weights {target} (--target-dtype: {how})" if target != "fp32" else ""
    return (
        f", draft weights {raw['draft_dtype']} (--draft-dtype)" if raw.get("draft_dtype") else ""
    ) + retargeted


def _synthetic_setting(raw: dict) -> str:
    """What stood in for real weights or real outcomes (older result files have none of it)."""
    parts = []
    if raw.get("load_format", "auto") != "auto":
        parts.append(f"load_format {raw['load_format']} (random weights)")
    if raw.get("synthetic_acceptance") is not None:
        parts.append(f"synthetic acceptance alpha = {raw['synthetic_acceptance']}")
    if raw.get("synthetic_hit") is not None:
        parts.append(f"synthetic SSD hit rate p = {raw['synthetic_hit']}")
    synthetic = raw.get("synthetic_acceptance") is not None or raw.get("synthetic_hit") is not None
    return (
        "; **"
        + ", ".join(parts)
        + (": speculative outputs are not the target's" if synthetic else "")
        + "**"
        if parts
        else ""
    )


def render(raw: dict) -> str:
    lines = [
        f"# Benchmark, {raw['date']}",
        "",
        f"- Machine: {raw['machine']}",
        f"- Placement: {raw['placement']}",
        f"- Target: `{raw['target']}`",
        f"- Draft: `{raw['draft']}`",
        f"- Command: `{raw['command']}`",
        f"- Settings: temperature {raw['temperature']}, {raw['new_tokens']} new tokens per prompt (EOS ignored), "
        f"{raw['num_prompts']} prompts per set, batch sizes {raw['batch']}, K {raw['k']}, {raw['dtype']}"
        f"{_draft_setting(raw)}{_synthetic_setting(raw)}; "
        "decode tok/s = tokens after each request's first / time after the batch's last first token; "
        "e2e tok/s includes prefill; acceptance = accepted / drafted, mean acceptance length = tokens per "
        "verification round incl. the bonus (vLLM definitions); hit rate = SSD cache hits after a sequence's "
        "first round.",
        "",
        "## Headline (the paper's columns)",
        "",
    ]
    lines += headline_lines(raw)
    from suite.goals import goal_lines  # goals.py builds on this module's helpers

    goals = goal_lines(raw)
    if goals:
        lines += [
            "## Goals (decode tok/s ratios, each mode at its best K, mean over the prompt sets)",
            "",
        ] + goals
    lines += ["## Every cell", ""] + detail_lines(raw)
    if rows_of(raw, "ssd"):
        lines += ["## SSD against Theorem 7 and Corollary 9", ""] + ssd_lines(raw)
    profile = profile_lines(raw) + efficiency_lines(raw)
    if profile:
        lines += ["## Where a round's time goes (batch 1)", ""] + profile
    lines += ["## Peak memory", ""] + memory_lines(raw) + costs_lines(raw)
    skipped = [b for b in raw["batch"] if b != 1] if "hf-assisted" in raw["results"] else []
    if skipped:
        lines.append(
            f"hf-assisted is batch 1 only (transformers' assisted generation); batch {skipped} not measured."
        )
    return "\n".join(lines).rstrip() + "\n"
