"""How far each target format moves the model from the checkpoint (issue: a re-quantized target is
another model; say by how much). For each format, against fp32 on the same prompts:

- greedy agreement: our AR's greedy tokens in that format against fp32's (identical outputs, tokens
  equal at the same position, mean tokens before the first difference);
- teacher-forced on fp32's greedy path: mean KL(fp32 || format) of the next-token law per position
  and the share of positions whose argmax agrees.

`llamacpp` is llama.cpp itself on the same GGUF file (through llama-cpp-python, `pip install
llama-cpp-python`; its own arithmetic, threads = this process's cores), measured the same way: the
anchor a default format's fidelity is held to.

    python benchmarks/fidelity.py [--formats gguf,gguf-int8,bf16,int8,int4,llamacpp] [--num-prompts 4] [--new-tokens 64]

Writes benchmarks/results/DATE-fidelity.md (and prints it); the machine line says where it ran.
"""

import argparse
import datetime
import os
import sys
from dataclasses import replace

import torch

BLOCK = 16


def llamacpp():
    """llama.cpp on the built-in target's GGUF file, every position's logits kept."""
    from llamacpp_mode import load_llama

    from ssd_engine.models.default_models import resolve_default_model
    from ssd_engine.models.gguf_files import source_gguf

    return load_llama(
        model_path=str(source_gguf(resolve_default_model("target"))),
        n_ctx=4096,
        n_batch=512,
        logits_all=True,
        n_threads=len(os.sched_getaffinity(0)),
        verbose=False,
    )


def llamacpp_laws(model, tokens: list[list[int]], rows: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, llama.cpp's log-softmax at the given positions (each the law of the next token)."""
    laws = []
    for seq, wanted in zip(tokens, rows):
        model.reset()
        model.eval(seq)
        logits = torch.from_numpy(model.scores[: len(seq)].copy())[wanted]
        laws.append(torch.log_softmax(logits.double(), dim=-1))
    return laws


def greedy(fmt: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from ssd_engine import LLM, SamplingParams

    if fmt == "llamacpp":
        model, outputs = llamacpp(), []
        for prompt in prompts:
            model.reset()
            model.eval(prompt)
            out = []
            for _ in range(new_tokens):
                out.append(int(model.scores[model.n_tokens - 1].argmax()))
                model.eval(out[-1:])
            outputs.append(out)
        return outputs

    with LLM(speculative_mode="ar", target_dtype=fmt) as llm:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def path_laws(fmt: str, prompts: list[list[int]], paths: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, the log-softmax of the target (in `fmt`) before each token of its fp32 path."""
    if fmt == "llamacpp":
        return llamacpp_laws(
            llamacpp(),
            [p + c for p, c in zip(prompts, paths)],
            [list(range(len(p) - 1, len(p) + len(c) - 1)) for p, c in zip(prompts, paths)],
        )
    from ssd_engine.core.config import EngineConfig
    from ssd_engine.planning.plan import plan
    from ssd_engine.runtime.model_runner import RunnerSpec
    from ssd_engine.runtime.step_inputs import StepInputs

    longest = max(len(p) + len(c) for p, c in zip(prompts, paths))
    blocks = -(-longest // BLOCK)
    options = EngineConfig.from_kwargs(speculative_mode="ar", target_dtype=fmt, block_size=BLOCK)
    config = plan(options).config
    runner = RunnerSpec(
        config.model, replace(config.cache, num_kv_blocks=blocks), longest + 1
    ).build()
    laws = []
    for prompt, path in zip(prompts, paths):
        tokens = prompt + path
        rows = list(range(len(prompt) - 1, len(tokens) - 1))
        logits = runner.run(StepInputs([0], [tokens], [list(range(blocks))], [rows]))
        laws.append(torch.log_softmax(logits.double(), dim=-1))
    del runner
    return laws


def compare(reference: list[list[int]], outputs: list[list[int]]) -> tuple[int, float, float]:
    """(identical outputs, share of equal tokens at the same position, mean tokens before the first difference)."""
    same = sum(a == b for a, b in zip(reference, outputs))
    pairs = [(x, y) for a, b in zip(reference, outputs) for x, y in zip(a, b)]
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for a, b in zip(reference, outputs)
    ]
    return same, sum(x == y for x, y in pairs) / len(pairs), sum(first) / len(first)


def main(argv: list[str] | None = None) -> str:
    from bench import load_prompts
    from suite.dated_report import write_dated_report
    from suite.machine import machine_line

    from ssd_engine.models.model_paths import resolve_model_arg
    from ssd_engine.models.tokenizer_source import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="gguf,gguf-int8,bf16,int8,int4")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(resolve_model_arg(None), None, "auto", 0)
    prompts = [tokenizer.encode(text) for text in load_prompts("humaneval", args.num_prompts)]
    reference = greedy("fp32", prompts, args.new_tokens)
    reference_laws = path_laws("fp32", prompts, reference)
    lines = [
        f"# Target formats against fp32, {datetime.date.today().isoformat()}",
        "",
        f"- Machine: {machine_line('cpu')}",
        f"- Built-in target, HumanEval x {args.num_prompts}, {args.new_tokens} greedy tokens; "
        f"`python benchmarks/fidelity.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| format | identical outputs | same token at a position | tokens before the first difference "
        "| mean KL(fp32 \\|\\| format), nats | argmax agreement on fp32's path |",
        "|---|---|---|---|---|---|",
    ]
    for fmt in args.formats.split(","):
        same, share, first = compare(reference, greedy(fmt, prompts, args.new_tokens))
        laws = path_laws(fmt, prompts, reference)
        width = min(
            reference_laws[0].shape[-1], laws[0].shape[-1]
        )  # llama.cpp's vocabulary may be the tokenizer's
        laws = [torch.log_softmax(q[:, :width], dim=-1) for q in laws]
        reference_cut = [torch.log_softmax(p[:, :width], dim=-1) for p in reference_laws]
        kl = torch.cat([(p.exp() * (p - q)).sum(-1) for p, q in zip(reference_cut, laws)])
        agree = (
            torch.cat([p.argmax(-1) == q.argmax(-1) for p, q in zip(reference_cut, laws)])
            .double()
            .mean()
        )
        lines.append(
            f"| {fmt} | {same}/{len(prompts)} | {share:.1%} | {first:.1f} | {kl.mean().item():.2e} "
            f"| {agree.item():.1%} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    write_dated_report(args.out, "fidelity", text)
    print(text)
    return text


if __name__ == "__main__":
    main()
