"""CLI: python -m ssd_engine.generate --prompt "def quicksort(arr):"

Prints each completion, then stats on stderr. Bad input prints one `error: ...` line and exits 2
(refused before loading where no model is needed); Ctrl-C exits 130."""

import contextlib
import os
import sys
import time

from ssd_engine.cli_args import (
    ArgumentParser,
    add_engine_args,
    add_sampling_args,
    describe_engine,
    engine_options,
    fail,
    sampling_params,
)
from ssd_engine.core.config import EngineConfig
from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.utils.progress import PROGRESS_ENV

DEFAULT_PROMPT = "def quicksort(arr):"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m ssd_engine.generate",
        allow_abbrev=False,
        description="Generate text for each --prompt with the built-in model pair, or your "
        "--model (and --draft-model); print it, then stats on stderr. It samples "
        "unless told otherwise (the sampling flags' defaults below, vLLM's rule): "
        "--temperature 0 gives the greedy, reproducible output.",
        epilog="Exit status: 0 done; 2 bad input (one `error: ...` line, refused before "
        "loading when no model is needed to tell); 130 interrupted (Ctrl-C).",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        help=f"prompt text (repeat for a batch; default: {DEFAULT_PROMPT!r})",
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="hide the progress bars (loading, generation)"
    )
    parser.add_argument(
        "--stream", action="store_true", help="print the text as it is generated (one prompt)"
    )
    add_engine_args(parser)
    add_sampling_args(parser, defaults={"max_tokens": 128})
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prompts, params = checked_request(args)
        EngineConfig.from_kwargs(**engine_options(args))
    except ValueError as error:
        fail(str(error))  # before anything loads: a typo costs no loading time
    with _no_progress_bars() if args.no_progress else contextlib.nullcontext():
        return _generate(prompts, params, args)


def _generate(prompts: list[str], params: SamplingParams, args) -> int:
    llm = None
    try:
        from ssd_engine import LLM

        started = time.perf_counter()
        llm = LLM(**engine_options(args))
        load_s = time.perf_counter() - started
        # unset flags: the model's defaults
        params = sampling_params(args, llm.get_default_sampling_params())
        outputs = run(llm, prompts, params, args)
        report(llm, outputs, load_s)
    except ValueError as error:
        fail(str(error))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)  # the finally below stops every child process
        return 130
    finally:
        if llm is not None:
            llm.close()
    return 0


@contextlib.contextmanager
def _no_progress_bars():
    """The loading and conversion bars read PROGRESS_ENV (ssd_engine/utils/progress.py), here and in the
    children started meanwhile (draft process, workers, converter), which inherit it."""
    before = os.environ.get(PROGRESS_ENV)
    os.environ[PROGRESS_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = before


def checked_request(args) -> tuple[list[str], SamplingParams]:
    """The prompts and sampling parameters, refused here if no model could ever run them (unset sampling
    flags checked with SamplingParams' defaults; the model's are filled in once it has loaded)."""
    prompts = args.prompt or [DEFAULT_PROMPT]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError("prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty")
    if args.stream and len(prompts) != 1:
        raise ValueError(f"--stream takes one prompt, got {len(prompts)}")
    if args.stream and (args.n or 1) > 1:
        raise ValueError("--stream takes one sample; leave --n at 1")
    return prompts, sampling_params(args)


def run(llm, prompts: list[str], params: SamplingParams, args) -> list:
    if args.chat:
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    if not args.stream:
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        samples = [(out.request_id, sample) for out in outputs for sample in out.outputs]
        for request_id, sample in samples:
            label = f"{request_id}" + (f".{sample.index}" if params.n > 1 else "")
            print(
                sample.text
                if len(samples) == 1
                else f"--- [{label}] finish={sample.finish_reason}\n{sample.text}"
            )
            # --logprobs N: a line a token, the chosen one first
            for entry in sample.logprobs or []:
                print(
                    "logprobs "
                    + "  ".join(f"{llm.tokenizer.decode([t])!r} {v:.4f}" for t, v in entry.items())
                )
        return outputs
    stream = llm.generate_stream(prompts[0], params)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    return [stream.output]


def report(llm, outputs: list, load_s: float) -> None:
    """The closing stats lines, on stderr."""
    tokens = sum(o.metrics.num_output_tokens for o in outputs)
    e2e = max(o.metrics.e2e_s for o in outputs)
    ttft = sum(o.metrics.ttft_s for o in outputs) / len(outputs)
    decode = sum(o.metrics.decode_tokens_per_s for o in outputs) / len(outputs)
    print(describe_engine(llm), file=sys.stderr)
    print(
        f"[stats] requests={len(outputs)} output_tokens={tokens} load={load_s:.1f}s e2e={e2e:.2f}s "
        f"ttft={ttft:.2f}s decode={decode:.2f} tok/s throughput={tokens / e2e:.2f} tok/s",
        file=sys.stderr,
    )
    if llm.engine.plan.mode != "ar":  # the mode that ran: "auto" resolves to one
        metrics = llm.speculation_metrics()
        print(
            f"[spec] mode={llm.engine.plan.mode} k={llm.engine.k} "
            f"acceptance_rate={metrics['acceptance_rate']:.3f} mean_acceptance_length={metrics['mean_acceptance_length']:.2f} "
            f"per_position={[round(x, 3) for x in metrics['per_position_acceptance_rate']]} "
            f"histogram={metrics['accepted_length_histogram']}",
            file=sys.stderr,
        )
        if "cache_hit_rate" in metrics:
            by_accepted = {
                accepted: round(rate, 3)
                for accepted, rate in metrics["cache_hit_rate_by_accepted"].items()
            }
            print(
                f"[ssd] cache_hit_rate={metrics['cache_hit_rate']:.3f} (after the first round: "
                f"{metrics['cache_hit_rate_warm']:.3f}) by_accepted={by_accepted} acceptance_on_hits={metrics['acceptance_on_hits']:.3f} "
                f"acceptance_on_misses={metrics['acceptance_on_misses']:.3f} "
                f"speculations={metrics['speculations_by_source']} T_p={metrics['T_p']:.2f} "
                f"(draft build {metrics['draft_build_s_per_round'] * 1e3:.0f} ms / verify "
                f"{metrics['verify_s_per_round'] * 1e3:.0f} ms per round; wait for draft "
                f"{metrics['coordinator_wait_s_per_round'] * 1e3:.0f} ms) draft_failures={len(metrics['draft_failures'])}",
                file=sys.stderr,
            )
            print(
                f"[saguaro] fanouts={metrics['fanouts']} C={llm.config.speculative.ssd.saguaro_c} fallback={metrics['fallback']} "
                f"b*={metrics['critical_batch_size']:.2f} backup_rounds={metrics['backup_rounds']} "
                f"miss_rate_by_fanout={[round(m, 3) for m in metrics['miss_rate_by_fanout']]}",
                file=sys.stderr,
            )


if __name__ == "__main__":
    sys.exit(main())
