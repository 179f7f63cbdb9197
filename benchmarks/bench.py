"""The benchmark suite: AR / SD / SSD and transformers' peers side by side, in the paper's shape.

    python benchmarks/bench.py                       # default pair, 4 HumanEval problems, ar,sd,ssd, batch 1
    python benchmarks/bench.py --mode ar,sd,ssd,hf-ar,hf-assisted --prompts humaneval,gsm8k,alpaca,mtbench
    python benchmarks/bench.py --batch 1,2,4,8 --k 2,4 --temperature 0.7
    python benchmarks/bench.py --device cuda --tp 1  # the target on GPU 0, the SSD draft on GPU 1
    python benchmarks/bench.py --mode ar,sd,ar-all,sd-all,ssd,auto --draft-dtype int4  # every ratio goal

Modes: `ar`, `sd`, `ssd` (our engine), `ar-all` and `sd-all` (our AR / SD on the target's and the
draft's cores together: the baselines for SSD, which uses both), `auto` (our engine on both sets
choosing AR / SD / SSD and K itself; run once, not per --k), `hf-ar` (transformers `generate`),
`hf-assisted` (transformers assisted generation), `llamacpp` and `llamacpp-all` (llama.cpp on the
target's GGUF where ar / ar-all run; benchmarks/llamacpp_mode.py, `pip install "ssd_engine[llamacpp]"`).
`--draft-dtype` sets our draft's weight format, `--target-dtype` our target's (bf16/int8/int4
re-quantize it: another model, reproduced exactly).
Without meaningful weights: `--load-format dummy` (random weights from config.json) with
`--synthetic-acceptance ALPHA [--synthetic-hit P]` (drafts accepted, SSD lookups hit, at those rates:
outputs are then not the target's); benchmarks/bench_synthetic.py sweeps them against the theory.
Each mode runs in its own pinned subprocess on the same prompts. Writes
`benchmarks/results/DATE-bench[-TAG].md` (tables), `.json` (raw numbers, machine, CPU model and
flags, placement, torch version, git commit) and PNG plots, into the committed results unless
`--out DIR` names another folder (`--tag TAG` names the files); `--readme` also puts the headline
table into README.md; `python benchmarks/bench.py --report RESULT.json` prints an earlier run's
tables again.
See `python benchmarks/bench.py --help` for every flag, benchmarks/suite/ for how it measures.
"""

import datetime
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def load_prompts(name: str, count: int) -> list[str]:
    from prompt_sets import PromptSetError, load_prompt_set

    try:
        return load_prompt_set(name, count)
    except PromptSetError as error:
        sys.exit(f"error: {error}")


def update_readme(raw: dict, base: str, readme: str) -> None:
    """Replace README.md's benchmark section (between the bench markers) with this run's headline."""
    from suite.report import headline_lines

    with open(readme) as f:
        text = f.read()
    if README_START not in text or README_END not in text:
        print(
            f"README has no {README_START} ... {README_END} section; not updated", file=sys.stderr
        )
        return
    name = os.path.relpath(base, os.path.dirname(readme))
    body = [
        f"Latest run ({raw['date']}, `{raw['command']}`; full report `{name}.md`):",
        "",
        f"{raw['machine']}; {raw['placement']}.",
        "",
    ] + headline_lines(raw)
    section = README_START + "\n" + "\n".join(body).rstrip() + "\n" + README_END
    text = re.sub(
        re.escape(README_START) + ".*?" + re.escape(README_END), lambda _: section, text, flags=re.S
    )
    with open(readme, "w") as f:
        f.write(text)
    print(f"updated {readme}", file=sys.stderr)


def where_results_go(out: str, tag: str) -> str:
    """The line bench.py starts with: the folder it will write into, and, when that is the default
    (the repository's benchmarks/results/, where committed results live), how to write elsewhere."""
    from suite.options import RESULTS_DIR

    names = f"DATE-bench{'-' + tag if tag else ''}.*"
    line = f"results: {os.path.join(out, names)}"
    if os.path.abspath(out) == os.path.abspath(RESULTS_DIR):
        line += " (the repository's committed results; --out DIR writes elsewhere, --tag TAG names the files)"
    return line


def render(raw: dict) -> str:
    """The report: suite/report.py's, then the llama.cpp section when a llama.cpp mode ran."""
    from llamacpp_mode import section_lines
    from suite import report

    extra = section_lines(raw)
    return report.render(raw) + ("\n" + "\n".join(extra).rstrip() + "\n" if extra else "")


def main(argv: list[str] | None = None) -> dict:
    import llamacpp_mode
    from suite import host_speed, options, plots
    from suite.machine import machine_line

    from ssd_engine.utils.machine import describe

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--report"] and len(argv) == 2:  # re-render an earlier run's tables
        with open(argv[1]) as f:
            raw = json.load(f)
        print(render(raw))
        return raw
    # the llama.cpp modes are bench.py's, not suite/options.py's: checked here, before anything loads
    our_argv, modes, model_arg = llamacpp_mode.split_argv(argv)
    gguf = None
    try:
        if any(m in llamacpp_mode.MODES for m in modes):
            llamacpp_mode.require_llama_cpp()
            gguf = llamacpp_mode.gguf_for(model_arg)
        opts = options.parse(our_argv)
        if gguf is not None:
            llamacpp_mode.check(opts)
            opts.modes = modes
    except llamacpp_mode.LlamaCppError as error:
        sys.exit(f"error: {error}")
    print(where_results_go(opts.out, opts.tag), file=sys.stderr)
    prompt_sets = {name: load_prompts(name, opts.num_prompts) for name in opts.prompt_sets}
    speed_before = host_speed.measure()
    results = llamacpp_mode.run_modes(opts.modes, opts, prompt_sets, gguf)
    speed_after = host_speed.measure()

    stamp = datetime.date.today().isoformat()
    raw = {
        "date": stamp,
        "machine": machine_line(opts.device)
        + "; "
        + host_speed.describe(speed_before, speed_after),
        "host_speed": host_speed.as_dict(speed_before, speed_after),
        "cpu": describe(),
        "placement": opts.placement_text() + llamacpp_mode.placement_text(opts.modes, opts),
        "command": "python benchmarks/bench.py " + " ".join(argv),
        "target": opts.model,
        "draft": opts.draft,
        "temperature": opts.temperature,
        "new_tokens": opts.new_tokens,
        "num_prompts": opts.num_prompts,
        "prompt_sets": opts.prompt_sets,
        "batch": opts.batch,
        "k": opts.k,
        "dtype": opts.dtype,
        "draft_dtype": opts.draft_dtype,
        "target_dtype": opts.target_dtype,
        "prefix": opts.prefix,
        "reps": opts.reps,
        "passes": opts.passes,
        "load_format": opts.load_format,
        "synthetic_acceptance": opts.synthetic_acceptance,
        "synthetic_hit": opts.synthetic_hit,
        "results": results,
    }
    os.makedirs(opts.out, exist_ok=True)
    base = os.path.join(opts.out, f"{stamp}-bench" + (f"-{opts.tag}" if opts.tag else ""))
    # first: a run's measurements outlive any bug in the tables
    with open(base + ".json", "w") as f:
        json.dump(
            raw, f
        )  # every output's token ids included: `--report` re-renders the tables from it
    text = render(raw)
    print(text)
    with open(base + ".md", "w") as f:
        f.write(text)
    written = [base + ".md", base + ".json"]
    try:
        written += plots.draw_all(raw, base)
    except ImportError as error:
        print(
            f"no plots ({error}): pip install matplotlib, then python benchmarks/plot.py {base}.json",
            file=sys.stderr,
        )
    if opts.readme:
        update_readme(raw, base, os.path.join(os.path.dirname(HERE), "README.md"))
    print(
        f"wrote into {os.path.abspath(opts.out)}: "
        + ", ".join(os.path.basename(p) for p in written),
        file=sys.stderr,
    )
    return raw


if __name__ == "__main__":
    main()
