"""Plot an SD benchmark: tok/s vs K, one line per speculative mode, AR baselines as horizontal
lines, one subplot per prompt set.

    python benchmarks/plot.py benchmarks/results/DATE-sd.json [out.png]

bench.py calls `plot_sd` itself at the end of an SD run.
"""
import json
import sys

STYLE = {  # ours blue, transformers orange; AR baselines dotted, speculative modes with markers
    "ar": dict(color="tab:blue", linestyle=":"),
    "hf-ar": dict(color="tab:orange", linestyle=":"),
    "sd": dict(color="tab:blue", linestyle="-", marker="o"),
    "hf-assisted": dict(color="tab:orange", linestyle="--", marker="s"),
    "ssd": dict(color="tab:green", linestyle="-", marker="^"),
    "ar-all": dict(color="tab:gray", linestyle=":"),
}


def plot_sd(raw: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets, ks, results = raw["prompt_sets"], raw["k"], raw["results"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4.2), squeeze=False, sharey=True)
    top = max(e["tok_s"] for r in results.values() for name in sets for e in r["runs"][name])
    for ax, name in zip(axes[0], sets):
        for index, (mode, result) in enumerate(results.items()):
            entries = result["runs"][name]
            style = STYLE.get(mode, {})
            color = style.get("color", f"C{index}")
            if entries[0]["k"] is None:  # an AR baseline: a horizontal line, its value at one end
                tok_s = entries[0]["tok_s"]
                ax.axhline(tok_s, label=mode, linewidth=1.5, **{k: v for k, v in style.items() if k != "marker"})
                right = mode.startswith("hf")  # ours at the left end, transformers' at the right
                ax.annotate(f"{mode} {tok_s:.1f}", (1 if right else 0, tok_s), xycoords=("axes fraction", "data"),
                            textcoords="offset points", xytext=(-3 if right else 3, 3),
                            ha="right" if right else "left", fontsize=7, color=color)
            else:
                ax.plot([e["k"] for e in entries], [e["tok_s"] for e in entries], label=mode, linewidth=1.8, **style)
                below = mode.startswith("hf")  # keeps the two engines' labels apart where the lines meet
                for e in entries:
                    if e.get("mean_acceptance_length"):
                        ax.annotate(f"L={e['mean_acceptance_length']:.2f}", (e["k"], e["tok_s"]),
                                    textcoords="offset points", xytext=(0, -12 if below else 6), ha="center",
                                    fontsize=7, color=color)
        ax.set_title(f"{name} prompts")
        ax.set_xlabel("K (draft tokens per round)")
        ax.set_xticks(ks)
        ax.set_xlim(min(ks) - 0.4, max(ks) + 0.4)
        ax.set_ylim(0, 1.15 * top)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("tok/s (batch 1, greedy)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"Speculative decoding, {raw['date']}, {raw['new_tokens']} new tokens; "
                 f"L = mean acceptance length", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        raw = json.load(f)
    out = sys.argv[2] if len(sys.argv) == 3 else sys.argv[1].rsplit(".", 1)[0] + ".png"
    plot_sd(raw, out)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
