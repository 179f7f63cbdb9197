"""LLM: the offline Python API (vLLM-style `LLM(...).generate()`)."""

import time
from dataclasses import replace

from tqdm.auto import tqdm

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.outputs import RequestOutput
from ssd_engine.core.sampling_params import SamplingParams, model_sampling_defaults
from ssd_engine.engine.llm_engine import LLMEngine
from ssd_engine.engine.streaming import TextStream

Prompt = str | list[int]


class LLM:
    """`LLM(model=None, **options)`; model=None runs the built-in default pair's target. Options
    are EngineConfig's, by their public (flat) names; an unknown one raises ValueError naming the
    closest. `config` is the EngineConfig as given; `engine.plan.config` is what planning resolved."""

    def __init__(self, model: str | None = None, **options) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self._engine: LLMEngine | None = LLMEngine(self.config)
        self._final_metrics: dict | None = (
            None  # what speculation_metrics() said when the engine closed
        )
        self._model_sampling_defaults: dict | None = (
            None  # read from generation_config.json when first needed
        )
        self.tokenizer = self._engine.tokenizer

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError(
                "this LLM is closed: generate inside its `with` block, or before close()"
            )
        return self._engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without params gets, and what unset fields take (DEFAULTS_RULE): the
        model's generation_config.json values where set, else SamplingParams' (it samples)."""
        if self._model_sampling_defaults is None:
            self._model_sampling_defaults = model_sampling_defaults(self.engine.model_path)
        return SamplingParams(**self._model_sampling_defaults)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in input order. Without sampling_params:
        get_default_sampling_params(). Every prompt is validated before any is queued, so a bad one
        raises ValueError without disturbing requests already in flight."""
        prompts = _as_prompt_list(prompts)
        if isinstance(sampling_params, list):
            params = sampling_params
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        requests = []  # per prompt, its params.n samples
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                requests.append(self.engine.make_samples(prompt, p))
            except ValueError as error:
                raise ValueError(
                    f"prompt {i}: {error}" if len(prompts) > 1 else str(error)
                ) from None
        for seq in (seq for samples in requests for seq in samples):
            self.engine.add(seq)
        outputs = iter(self._run([seq for samples in requests for seq in samples], use_tqdm))
        return [_one_request([next(outputs) for _ in samples]) for samples in requests]

    def _run(self, seqs, use_tqdm: bool) -> list[RequestOutput]:
        pending = {seq.seq_id for seq in seqs}
        # counts generated tokens, not requests (one request would sit at 0/1 until it is done);
        # the total is every request's max_tokens, less what requests that stopped early left unused
        bar = tqdm(
            total=sum(seq.params.max_tokens for seq in seqs),
            desc="Generating",
            unit="tok",
            dynamic_ncols=True,
            disable=not use_tqdm,
        )
        stats = self.engine.stats
        while pending:
            before, start = dict(stats), time.perf_counter()
            finished = self.engine.step()
            elapsed = max(time.perf_counter() - start, 1e-9)
            prefill = stats["prefill_tokens"] - before["prefill_tokens"]
            decode = stats["decode_tokens"] - before["decode_tokens"]
            done = [seq for seq in finished if seq.seq_id in pending]
            pending -= {seq.seq_id for seq in done}
            bar.total -= sum(seq.params.max_tokens - seq.num_output_tokens for seq in done)
            if prefill or decode or done:
                bar.set_postfix(
                    {
                        "requests": f"{len(seqs) - len(pending)}/{len(seqs)}",
                        "prefill": f"{prefill / elapsed:.0f} tok/s" if prefill else "-",
                        "decode": f"{decode / elapsed:.1f} tok/s" if decode else "-",
                    },
                    refresh=False,
                )
            bar.update(sum(seq.num_output_tokens for seq in seqs) - bar.n)
        bar.close()
        return [self.engine.to_output(seq) for seq in seqs]

    def generate_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> TextStream:
        """Queue one request and return a TextStream: iterate it for text increments (they join to
        the final text; `.output` holds the RequestOutput afterwards). Iterating steps the whole
        engine, so other queued requests advance too; closing the stream early cancels the request.
        A bad request raises ValueError here, before anything is queued."""
        params = sampling_params or self.get_default_sampling_params()
        if params.n > 1:
            raise ValueError(
                f"n must be 1 for a stream, got {params.n}: generate() returns n samples"
            )
        seq = self.engine.make_sequence(prompt, params)
        self.engine.add(seq)
        return TextStream(self.engine, seq)

    def speculation_metrics(self) -> dict:
        """Engine-wide acceptance metrics (vLLM definitions; empty counters in AR mode), plus in SSD
        mode the cache-hit rates, acceptance on hits and misses, fallbacks, draft failures and T_p.
        After close() (a `with` block's end): the metrics as they stood when the engine closed."""
        if self._engine is None:
            return dict(self._final_metrics)
        return self._engine.speculation_metrics()

    def close(self) -> None:
        """Stop every child process (draft process, tensor-parallel workers); safe to call twice."""
        if self._engine is not None:
            self._final_metrics = self.speculation_metrics()
            self._engine.close()
        self._engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if isinstance(prompts, list) and not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    if not isinstance(prompts, list):
        raise ValueError("prompts must be a string, a list of strings, or lists of token ids")
    return prompts


def _one_request(samples: list[RequestOutput]) -> RequestOutput:
    """A request's outputs: the first sample's, holding every sample in `outputs`."""
    first = samples[0]
    if len(samples) > 1:
        first.outputs = [replace(sample.outputs[0], index=i) for i, sample in enumerate(samples)]
    return first
