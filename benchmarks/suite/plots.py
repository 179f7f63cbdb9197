"""PNG plots of one bench.py run (matplotlib, headless): tok/s per mode per prompt set, SSD/SD
against batch size, and tok/s against K when several K ran. `python benchmarks/plot.py RESULT.json`
redraws them from the raw JSON."""

from suite.report import best_k, rows_of

COLORS = {
    "ar": "tab:blue",
    "ar-all": "tab:gray",
    "sd": "tab:orange",
    "sd-all": "tab:brown",
    "ssd": "tab:green",
    "auto": "tab:olive",
    "hf-ar": "tab:purple",
    "hf-assisted": "tab:red",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cell(raw: dict, mode: str, name: str, batch: int) -> dict | None:
    rows = rows_of(raw, mode, set=name, batch=batch, k=best_k(raw, mode, batch))
    return rows[0] if rows else None


def fitted_suptitle(fig, text: str, fontsize: float = 10):
    """fig.suptitle(text), wrapped at spaces onto as many lines as the figure's width needs: a long
    title (a date, settings) over a narrow figure (one prompt set) is never clipped. Call
    fig.tight_layout() after it, which makes room for the lines."""
    import textwrap

    renderer = fig.canvas.get_renderer()
    title = fig.suptitle(text, fontsize=fontsize)
    for width in range(len(text) - 1, 8, -1):
        if title.get_window_extent(renderer).width <= 0.95 * fig.bbox.width:
            break
        title.set_text(textwrap.fill(text, width, break_long_words=False))
    return title


def throughput_figure(raw: dict, batch: int = 1):
    """The throughput plot's figure (the caller saves and closes it)."""
    plt = _pyplot()
    sets, modes = raw["prompt_sets"], list(raw["results"])
    width = 0.8 / len(modes)
    legend_columns = min(len(modes), 4)
    legend_rows = -(-len(modes) // legend_columns)
    fig, ax = plt.subplots(
        figsize=(
            min(14.0, max(5.0, 2.0 + len(sets) * (0.5 + 0.35 * len(modes)))),
            4.4 + 0.2 * (legend_rows - 1),
        )
    )
    for i, mode in enumerate(modes):
        cells = [_cell(raw, mode, name, batch) for name in sets]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(sets))]
        values = [c["decode_tok_s"] if c else 0.0 for c in cells]
        bars = ax.bar(xs, values, width, label=mode, color=COLORS.get(mode))
        ax.bar_label(bars, labels=[f"{v:.1f}" if v else "" for v in values], fontsize=7, padding=2)
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel(f"decode tok/s (batch {batch})")
    fitted_suptitle(
        fig,
        f"Throughput per mode, {raw['date']} (T = {raw['temperature']}, {raw['new_tokens']} tokens)",
    )
    ax.set_ylim(
        0,
        1.15
        * max(
            [c["decode_tok_s"] for m in modes for n in sets if (c := _cell(raw, m, n, batch))]
            or [1]
        ),
    )
    legend = fig.legend(
        *ax.get_legend_handles_labels(),
        loc="lower center",
        ncol=legend_columns,
        fontsize=8,
        frameon=False,
    )
    ax.grid(True, axis="y", alpha=0.3)
    legend_height = legend.get_window_extent(fig.canvas.get_renderer()).height / fig.bbox.height
    fig.tight_layout(rect=(0, legend_height + 0.01, 1, 1))
    return fig


def throughput(raw: dict, path: str, batch: int = 1) -> str:
    """Grouped bars: decode tok/s of every mode (its best K) per prompt set, at one batch size."""
    plt = _pyplot()
    fig = throughput_figure(raw, batch)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def batch_ratio(raw: dict, path: str) -> str | None:
    """SSD/SD decode throughput against batch size, one line per prompt set (needs both modes and
    at least two batch sizes)."""
    if len(raw["batch"]) < 2 or not (rows_of(raw, "sd") and rows_of(raw, "ssd")):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for name in raw["prompt_sets"]:
        points = []
        for batch in raw["batch"]:
            sd, ssd = _cell(raw, "sd", name, batch), _cell(raw, "ssd", name, batch)
            if sd and ssd:
                points.append((batch, ssd["decode_tok_s"] / sd["decode_tok_s"]))
        ax.plot(*zip(*points), marker="o", label=name)
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(raw["batch"], [str(b) for b in raw["batch"]])
    ax.set_xlabel("batch size")
    ax.set_ylabel("SSD / SD (decode tok/s)")
    ax.set_title(f"SSD over SD by batch size, {raw['date']}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def by_k(raw: dict, path: str) -> str | None:
    """Decode tok/s against K at batch 1, one subplot per prompt set; AR modes and auto as horizontal lines."""
    if len(raw["k"]) < 2:
        return None
    plt = _pyplot()
    sets = raw["prompt_sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], sets):
        for mode in raw["results"]:
            rows = rows_of(raw, mode, set=name, batch=1)
            # one K (auto's own): a level, not a curve
            if rows and (rows[0]["k"] is None or mode == "auto"):
                ax.axhline(
                    rows[0]["decode_tok_s"], color=COLORS.get(mode), linestyle=":", label=mode
                )
            elif rows:
                ax.plot(
                    [r["k"] for r in rows],
                    [r["decode_tok_s"] for r in rows],
                    marker="o",
                    label=mode,
                    color=COLORS.get(mode),
                )
        ax.set_title(name)
        ax.set_xlabel("K (draft tokens per round)")
        ax.set_xticks(raw["k"])
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("decode tok/s (batch 1)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_all(raw: dict, base: str) -> list[str]:
    """Every plot this run's data supports; -> the files written."""
    made = [
        throughput(raw, base + "-throughput.png"),
        batch_ratio(raw, base + "-batch.png"),
        by_k(raw, base + "-k.png"),
    ]
    return [path for path in made if path]
