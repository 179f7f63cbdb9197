"""Structured outputs on the built-in pair: does speculation keep paying under a JSON schema?

For AR, SD and SSD, the same chat prompts (each asks for a JSON record) run greedy, batch 1, with
their JSON schema (`structured_outputs`) and without, alternating prompt by prompt. Reported per mode and case: decode
tok/s, the drafts' acceptance rate, and, with the schema, how many outputs parse and validate
(`jsonschema`). The goal: SD and SSD with a schema keep >= 90% of their unconstrained speedup over AR.

    python benchmarks/structured.py [--modes ar,sd,ssd] [--max-tokens 160] [--repeat 1]

Writes benchmarks/results/DATE-structured.md (and prints it); the machine line says where it ran.
"""

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "born", "fields", "alive"],
    "additionalProperties": False,
}
FUNCTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "type": {"enum": ["int", "str", "float", "list", "dict", "bool"]},
                },
                "required": ["name", "type"],
            },
        },
        "returns": {"type": "string"},
    },
    "required": ["name", "arguments", "returns"],
    "additionalProperties": False,
}
TASKS = [
    (
        "Give a JSON record for Ada Lovelace with her name, birth year, fields of work and whether she is alive.",
        PERSON,
    ),
    (
        "Give a JSON record for Alan Turing with his name, birth year, fields of work and whether he is alive.",
        PERSON,
    ),
    (
        "Describe the Python function `def merge(a: list, b: list, key: str) -> dict` as JSON: its name, "
        "its arguments with their types, and its return type.",
        FUNCTION,
    ),
    (
        "Describe the Python function `def clamp(x: float, lo: float, hi: float) -> float` as JSON: its name, "
        "its arguments with their types, and its return type.",
        FUNCTION,
    ),
    (
        "Give a JSON record for Grace Hopper with her name, birth year, fields of work and whether she is alive.",
        PERSON,
    ),
    (
        "Give a JSON record for Linus Torvalds with his name, birth year, fields of work and whether he is alive.",
        PERSON,
    ),
    (
        "Describe the Python function `def tokenize(text: str, lower: bool) -> list` as JSON: its name, "
        "its arguments with their types, and its return type.",
        FUNCTION,
    ),
    (
        "Describe the Python function `def histogram(values: list, bins: int, normed: bool) -> dict` as JSON: its "
        "name, its arguments with their types, and its return type.",
        FUNCTION,
    ),
]


def run_mode(mode: str, max_tokens: int, repeat: int) -> dict:
    import jsonschema

    from ssd_engine import LLM, SamplingParams

    with LLM(speculative_mode=mode) as llm:
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": task}], tokenize=False, add_generation_prompt=True
            )
            for task, _ in TASKS
        ]
        llm.generate(
            prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )  # warm-up
        cases = {
            case: dict(tokens=0, seconds=0.0, drafted=0, accepted=0, valid=0, outputs=[])
            for case in ("schema", "free")
        }
        for _ in range(repeat):
            for prompt, (_, schema) in zip(prompts, TASKS):
                # the two cases alternate prompt by prompt: the host's drift over minutes falls on both alike
                for case, cell in cases.items():
                    structure = dict(json=schema) if case == "schema" else None
                    out = llm.generate(
                        [prompt],
                        SamplingParams(
                            temperature=0, max_tokens=max_tokens, structured_outputs=structure
                        ),
                        use_tqdm=False,
                    )[0]
                    cell["outputs"].append(out.token_ids)
                    cell["tokens"] += out.metrics.num_output_tokens - 1
                    cell["seconds"] += out.metrics.e2e_s - out.metrics.ttft_s
                    cell["drafted"] += out.spec_metrics.get("drafted", 0)
                    cell["accepted"] += out.spec_metrics.get("accepted", 0)
                    if case == "schema":
                        try:
                            jsonschema.validate(json.loads(out.text), schema)
                            cell["valid"] += 1
                        except (ValueError, jsonschema.ValidationError):
                            print(f"[{mode}] not valid: {out.text!r}", file=sys.stderr)
        for cell in cases.values():
            cell.update(
                tok_s=cell["tokens"] / cell["seconds"],
                count=len(cell["outputs"]),
                acceptance=cell["accepted"] / cell["drafted"] if cell["drafted"] else None,
            )
        return dict(cases=cases, execution=llm.engine.execution())


def main(argv: list[str] | None = None) -> str:
    from suite.dated_report import write_dated_report
    from suite.machine import machine_line

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="ar,sd,ssd")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    args = parser.parse_args(argv)
    results = {mode: run_mode(mode, args.max_tokens, args.repeat) for mode in args.modes.split(",")}
    ar = results.get("ar")
    lines = [
        f"# Structured outputs on the built-in pair, {datetime.date.today().isoformat()}",
        "",
        f"- Machine: {machine_line('cpu')}",
        f"- {len(TASKS)} chat prompts asking for JSON (2 schemas) x {args.repeat}, greedy, batch 1, up to "
        f"{args.max_tokens} tokens; `python benchmarks/structured.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| mode | engine | tok/s free | tok/s schema | acceptance free | acceptance schema | speedup over AR "
        "free / schema | kept | valid JSON with schema |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, result in results.items():
        free, schema = result["cases"]["free"], result["cases"]["schema"]
        accept = [
            f"{c['acceptance']:.2f}" if c["acceptance"] is not None else "-" for c in (free, schema)
        ]
        if ar is not None and mode != "ar":
            up_free = free["tok_s"] / ar["cases"]["free"]["tok_s"]
            up_schema = schema["tok_s"] / ar["cases"]["schema"]["tok_s"]
            # a share of a gain within the run's noise (a few %) means nothing
            kept = (
                f"{(up_schema - 1) / (up_free - 1):.0%}" if up_free > 1.1 else "- (no gain to keep)"
            )
            speedup = f"{up_free:.2f}x / {up_schema:.2f}x"
        else:
            speedup, kept = "-", "-"
        engine = f"{result['execution']['mode']}, target {result['execution']['target_dtype']}"
        lines.append(
            f"| {mode} | {engine} | {free['tok_s']:.2f} | {schema['tok_s']:.2f} | {accept[0]} | {accept[1]} "
            f"| {speedup} | {kept} | {schema['valid']}/{schema['count']} |"
        )
    if ar is not None:
        same = all(
            r["cases"]["schema"]["outputs"] == ar["cases"]["schema"]["outputs"]
            for r in results.values()
        )
        lines += [
            "",
            f"Greedy outputs with the schema identical in every mode: {'yes' if same else 'NO'}.",
        ]
    lines += [
        "",
        "`kept`: (speedup with schema - 1) / (speedup free - 1), the share of the unconstrained gain "
        "over AR that survives the schema.",
    ]
    text = "\n".join(lines) + "\n"
    write_dated_report(args.out, "structured", text)
    print(text)
    return text


if __name__ == "__main__":
    main()
