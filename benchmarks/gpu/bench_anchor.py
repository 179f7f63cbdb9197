"""The anchor: our AR decode against transformers' own `generate` on the same model shape, device and
dtype, side by side in one run (issue 22's goal on a GPU: ours >= 1.5x transformers' static-cache
generate at the 1.5B shape, bf16, batch 1, a 512-token prompt, 128 new tokens).

    python benchmarks/gpu/bench_anchor.py --device cuda --model configs/shapes/qwen2.5-coder-1.5b-instruct
    python benchmarks/gpu/bench_anchor.py --model configs/shapes/qwen2.5-coder-0.5b-instruct --prompt-len 64 \
        --new-tokens 16 --hf dynamic                                      # a CPU smoke

Weights are random at the folder's shapes (our `load_format="dummy"`, transformers' `from_config`):
a decode step's cost does not depend on the weights' values, and a shape folder needs only its
config.json. The prompt is random token ids; every run generates exactly --new-tokens (EOS ignored).
transformers runs as `hf-dynamic` (its default dynamic cache, eager) and `hf-static` (a static cache,
with which `generate` compiles its decoding forward itself on a GPU: torch.compile, reduce-overhead,
so CUDA graphs; compiling the forward again on top of that nests two compiles, which outran a lent
GPU's call), each timed after one warm-up call that also compiles. Decode tok/s counts the tokens after the first over the
time after the first (prefill excluded, our RequestMetrics' definition); e2e tok/s includes it.
Writes benchmarks/results/DATE-anchor-DEVICE.md and .json, with the device and CPU named.
"""

import argparse
import datetime
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]  # suite/
HF_RUNS = ("dynamic", "static")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu/bench_anchor.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--model",
        default=os.path.join(REPO, "configs", "shapes", "qwen2.5-coder-1.5b-instruct"),
        help="model folder (config.json is enough)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed calls per runner (the best counts)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also ours with compile_model='on' (row ours-compiled)",
    )
    p.add_argument(
        "--hf", default="dynamic,static", help="transformers runs, from: " + ", ".join(HF_RUNS)
    )
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    a.hf = [r.strip() for r in a.hf.split(",") if r.strip()]
    if unknown := [r for r in a.hf if r not in HF_RUNS]:
        p.error(f"--hf: unknown run {unknown[0]!r}; choose from {', '.join(HF_RUNS)}")
    if a.prompt_len < 1 or a.new_tokens < 2 or a.repeats < 1:
        p.error("--prompt-len >= 1, --new-tokens >= 2 and --repeats >= 1 are needed")
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    return a


def _prompt(length: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()


def _sync(device: str):
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _best(rates: list[dict]) -> dict:
    return max(rates, key=lambda r: r["decode_tok_s"])


def run_ours(a, prompt: list[int], compiled: bool) -> dict:
    from ssd_engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    with LLM(
        a.model,
        speculative_mode="ar",
        device=a.device,
        dtype=a.dtype,
        load_format="dummy",
        max_model_len=a.prompt_len + a.new_tokens + 16,
        enable_prefix_caching=False,
        compile_model="on" if compiled else "off",
    ) as llm:
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        rates = []
        for _ in range(a.repeats):
            metrics = llm.generate([prompt], params, use_tqdm=False)[0].metrics
            assert metrics.num_output_tokens == a.new_tokens
            rates.append(
                {"decode_tok_s": metrics.decode_tokens_per_s, "e2e_tok_s": metrics.tokens_per_s}
            )
    return _best(rates)


def run_hf(a, prompt: list[int], cache: str) -> dict:
    import torch
    from suite.hf import FirstForward
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(a.model)
    model = (
        AutoModelForCausalLM.from_config(config, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    )
    sync = _sync(a.device)
    first = FirstForward(model, sync)
    extra = {}
    if cache == "static":
        extra["cache_implementation"] = "static"
    ids = torch.tensor([prompt], device=a.device)
    generate = dict(
        max_new_tokens=a.new_tokens,
        min_new_tokens=a.new_tokens,
        do_sample=False,
        pad_token_id=0,
        **extra,
    )
    rates = []
    with torch.inference_mode():
        model.generate(ids, **generate)  # warm-up (and the compile)
        for _ in range(a.repeats):
            first.at = None
            sync()
            begin = time.perf_counter()
            out = model.generate(ids, **generate)
            sync()
            end = time.perf_counter()
            assert out.shape[1] - ids.shape[1] == a.new_tokens
            rates.append(
                {
                    "decode_tok_s": (a.new_tokens - 1) / (end - first.at),
                    "e2e_tok_s": a.new_tokens / (end - begin),
                }
            )
    return _best(rates)


def markdown(result: dict) -> str:
    ours = max(
        rate["decode_tok_s"] for name, rate in result["runs"].items() if name.startswith("ours")
    )
    lines = [
        f"# Anchor: our AR against transformers' generate, {result['date']}",
        "",
        f"- Device: {result['machine']}; {result['placement']}",
        f"- Model: `{result['model']}` shapes, random weights, {result['dtype']}; batch 1, a {result['prompt_len']}-token "
        f"random-id prompt, {result['new_tokens']} new tokens (EOS ignored), best of {result['repeats']} timed calls",
        f"- Command: `{result['command']}`",
        "",
        "| runner | decode tok/s | e2e tok/s | our best / this (decode) |",
        "|---|---|---|---|",
    ]
    for name, rate in result["runs"].items():
        lines.append(
            f"| {name} | {rate['decode_tok_s']:.1f} | {rate['e2e_tok_s']:.1f} | {ours / rate['decode_tok_s']:.2f} |"
        )
    lines += ["", "Goal on a GPU (1.5B shape, bf16): ours >= 1.5x hf-static."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    from suite.dated_report import write_dated_result
    from suite.machine import machine_line

    from ssd_engine.models.loader import load_config
    from ssd_engine.utils.machine import describe

    prompt = _prompt(a.prompt_len, load_config(a.model, "dummy").vocab_size)
    import torch

    cores = sorted(os.sched_getaffinity(0))
    placement = (
        f"GPU {a.device}"
        if a.device.startswith("cuda")
        else f"both on cores {cores}, {len(cores)} thread(s)"
    )
    torch.set_num_threads(
        len(cores)
    )  # transformers' torch threads = ours (the engine takes the affinity)
    runners = {"ours": lambda: run_ours(a, prompt, compiled=False)}
    if a.compile:
        runners["ours-compiled"] = lambda: run_ours(a, prompt, compiled=True)
    runners.update(
        {f"hf-{cache}": (lambda cache=cache: run_hf(a, prompt, cache)) for cache in a.hf}
    )
    runs = {}
    for name, runner in runners.items():
        print(f"{name}: loading, warming up (and compiling)", file=sys.stderr, flush=True)
        runs[name] = runner()
        # each figure as it is measured: a run stopped at a time limit (a lent GPU's) keeps what it got
        print(
            f"{name}: decode {runs[name]['decode_tok_s']:.1f} tok/s, e2e {runs[name]['e2e_tok_s']:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_line(a.device),
        "cpu": describe(),
        "placement": placement,
        "model": os.path.relpath(os.path.abspath(a.model), REPO)
        if os.path.abspath(a.model).startswith(REPO)
        else os.path.basename(os.path.abspath(a.model)),
        "dtype": a.dtype,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "repeats": a.repeats,
        "command": " ".join(
            [
                *(
                    ["taskset", "-c", ",".join(map(str, cores))]
                    if len(cores) < os.cpu_count()
                    else []
                ),
                "python benchmarks/gpu/bench_anchor.py",
                *argv,
            ]
        ),
        "runs": runs,
    }
    text = markdown(result)
    print(text)
    base = write_dated_result(a.out, f"anchor-{a.device.split(':')[0]}", text, result)
    print(f"wrote {base}.md, {base}.json", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
