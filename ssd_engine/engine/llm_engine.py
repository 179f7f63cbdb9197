"""The step loop: schedule -> speculate -> verify -> postprocess (AR: no speculation; the scheduler
applies the results). Requests join and leave between steps (continuous batching)."""

import gc
import logging
import time
from dataclasses import replace

import torch

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.outputs import RequestOutput
from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.streams import Stream, stream_generator
from ssd_engine.core.structures import Outcome, Sequence, SequenceStatus
from ssd_engine.distributed.partition import check_splittable
from ssd_engine.distributed.placement import pin, unpin
from ssd_engine.engine.execution import describe_execution
from ssd_engine.engine.model_limits import eos_token_ids, max_model_len, num_kv_blocks
from ssd_engine.engine.output_processor import OutputProcessor
from ssd_engine.engine.prefill_pacer import PrefillPacer
from ssd_engine.engine.request_checks import check_request
from ssd_engine.engine.scheduler import Scheduler
from ssd_engine.engine.step_choice import StepChoice
from ssd_engine.models.loader import load_config
from ssd_engine.models.tokenizer_source import load_tokenizer
from ssd_engine.planning.formats import threads_on
from ssd_engine.planning.plan import plan
from ssd_engine.runtime.block_manager import BlockManager
from ssd_engine.runtime.model_runner import DTYPES, RunnerSpec
from ssd_engine.sampling.grammar import Grammars
from ssd_engine.sampling.synthetic import synthetic_acceptance
from ssd_engine.sampling.verifier import StepResult, Verifier
from ssd_engine.speculative.metrics import SpecMetrics
from ssd_engine.speculative.setup import TargetSide, build_sync_draft, start_async_draft
from ssd_engine.tensor_parallel.launch import close_at_exit, start_tensor_parallel, torchrun_world

log = logging.getLogger("ssd_engine")


class LLMEngine:
    def __init__(self, options: EngineConfig) -> None:
        self._pinned, self.runner, self.speculator = None, None, None  # built below
        self.step_choice: StepChoice | None = None  # SD's K chosen every step
        try:
            self.plan = plan(options)
            self.config = self.plan.config
            self._build()
        except BaseException:
            self.close()  # a half-built engine leaves no child process and no pinned cores behind
            raise

    def _build(self) -> None:
        config = self.config
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        core_sets = self._place()
        self.model_path = config.model.path
        self.hf_config = load_config(self.model_path, config.model.load_format)
        check_splittable(self.hf_config, config.parallel.tensor_parallel_size)
        self.tokenizer = load_tokenizer(
            self.model_path,
            config.model.tokenizer,
            config.model.load_format,
            self.hf_config.vocab_size,
        )
        self.max_model_len = max_model_len(self.hf_config, config.scheduler.max_model_len)
        self.device = torch.device(config.model.device)
        dtype = DTYPES[config.model.dtype]
        num_blocks = num_kv_blocks(config, self.hf_config, self.max_model_len, dtype)
        # verification and drafting run up to K positions past the last token
        max_position = self.max_model_len + config.speculative.k + 1
        target = RunnerSpec(
            config.model, replace(config.cache, num_kv_blocks=num_blocks), max_position
        )
        if config.parallel.tensor_parallel_size > 1 or torchrun_world() is not None:
            self.runner = start_tensor_parallel(
                config.parallel, target, core_sets and core_sets[:-1]
            )
        else:
            self.runner = target.build()
        self.block_manager = BlockManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        stall = config.scheduler.max_decode_stall
        self.scheduler = Scheduler(
            self.block_manager,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            config.scheduler.prefill_tokens_while_decoding,
            PrefillPacer(stall) if stall else None,
        )
        self.scheduler.tell_on_release(self.runner)  # tensor-parallel workers forget freed tables
        eos_ids = eos_token_ids(self.model_path, self.hf_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, eos_ids, self.max_model_len)
        eos = self.output_processor.eos_token_ids
        self.verifier = Verifier(
            stream_generator(config.seed, Stream.TARGET, device=self.device),  # unseeded requests
            synthetic_acceptance(config.speculative.synthetic_acceptance, config.seed),
            eos,
            Grammars(self.tokenizer, self.hf_config.vocab_size, eos),
        )
        self.scheduler.tell_on_release(self.verifier.grammars)
        self.spec_metrics = SpecMetrics(config.speculative.k)
        side = TargetSide(
            config,
            self.plan.draft,
            self.plan.saguaro,
            self.model_path,
            self.tokenizer,
            self.hf_config.vocab_size,
            tuple(eos),
            self.device,
            self.verifier.grammars,
        )
        speculative = config.speculative
        if speculative.mode == "sd":
            self.speculator = build_sync_draft(side, target)
            self.scheduler.tell_on_release(self.speculator)
            per_step = speculative.per_step == "goodput"
            start = self.plan.choice.k if self.plan.choice else None  # auto's best K, first tried
            self.step_choice = StepChoice(speculative.k, start) if per_step else None
        elif speculative.mode == "ssd":
            cores = core_sets[-1] if core_sets else None
            self.speculator = start_async_draft(
                side, target, cores, threads_on(config.model, cores)
            )
            self.scheduler.tell_on_release(self.speculator)
            close_at_exit(self)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0}
        self._capture_graphs()
        gc.freeze()  # the built heap is long-lived: full collections skip it (close() thaws it)

    def _capture_graphs(self) -> None:
        """CUDA graphs for the target's repeated steps: decode and verification of K + 1 tokens (of
        every k + 1 up to it where SD chooses k each step)."""
        ks = range(1, self.k + 1) if self.step_choice else [self.k] if self.k else []
        self.runner.capture_graphs([("paged", 1)] + [("paged", k + 1) for k in ks])

    def _place(self) -> list[list[int]] | None:
        """Pins this process (rank 0) to the first of the plan's core sets until close(); -> SSD's
        core sets (one per target rank, then the draft's), None otherwise."""
        sets = self.plan.core_sets
        if sets and self.config.parallel.tensor_parallel_size == 1:
            self._pinned = pin(sets[0], threads_on(self.config.model, sets[0]))
        return sets if self.config.speculative.mode == "ssd" else None

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """A one-line ValueError naming what makes this request impossible here (engine/request_checks.py)."""
        check_request(
            token_ids,
            params,
            self.hf_config.vocab_size,
            self.max_model_len,
            self.block_manager,
            self.scheduler.max_num_seqs,
            self.k,
        )
        if params.structured_outputs is not None:  # compiled once per spec: a bad one fails here
            self.verifier.grammars.compile(params.structured_outputs)

    @property
    def k(self) -> int:
        """Draft tokens a round: the plan's K, 0 without a speculator."""
        return self.config.speculative.k if self.speculator else 0

    def make_sequence(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Sequence:
        """Tokenize and validate one request without queuing it; raises ValueError if it can never run."""
        return self.make_samples(prompt, params)[0]

    def make_samples(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> list[Sequence]:
        """One request's params.n samples (the first leads: the others wait for its prompt's pages)."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        text = prompt if isinstance(prompt, str) else None
        first = Sequence(token_ids, params, self.config.cache.block_size, text)
        return [first] + [
            Sequence(token_ids, params, self.config.cache.block_size, text, i, first)
            for i in range(1, params.n)
        ]

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Sequence:
        """Queue one request; raises ValueError (and changes nothing) if it can never run."""
        seq = self.make_sequence(prompt, params)
        self.add(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a sequence from make_sequence / make_samples (already validated)."""
        self.scheduler.add(seq)

    def kv_capacity_tokens(self) -> int:
        """Tokens one sequence can hold in the whole KV cache, less a speculation round's drafts."""
        return self.block_manager.num_blocks * self.block_manager.block_size - self.k

    def speculation_metrics(self) -> dict:
        """Acceptance counters (vLLM's definitions), plus the speculator's summary (SSD: cache hits...)."""
        summary = self.spec_metrics.total.summary()
        if self.step_choice is not None:
            summary.update(self.step_choice.summary())
        return {**summary, **self.speculator.summary()} if self.speculator is not None else summary

    def reset_speculation_metrics(self) -> None:
        for metrics in filter(None, (self.spec_metrics, self.ssd_metrics, self.step_choice)):
            metrics.reset()

    @property
    def ssd_metrics(self):
        """SSD's round counters (speculative/ssd/metrics.SSDMetrics); None in other modes."""
        return getattr(self.speculator, "metrics", None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, seq: Sequence) -> None:
        """Cancel one request (a stream whose reader went away): its blocks and draft state are freed."""
        if seq.status != SequenceStatus.FINISHED:
            seq.metrics.finish_time = time.perf_counter()
            self.scheduler.abort(seq)
            self.spec_metrics.pop(seq.seq_id)

    def step(self) -> list[Sequence]:
        """One round: schedule, propose, forward, sample or verify; -> the sequences it finished."""
        started = time.perf_counter()
        scheduler, choice = self.scheduler, self.step_choice
        k = (
            choice.choose(scheduler.running, self.speculator, scheduler.prefill_pending())
            if choice
            else self.k
        )
        batch = scheduler.schedule(k)
        if not batch.seqs:
            if self.scheduler.has_unfinished():  # admission checks should make this impossible
                raise RuntimeError("scheduler made no progress")
            return []
        decoding = batch.decoding(k)
        proposal = self.speculator.propose(batch, decoding, k) if self.speculator and k else None
        speculated = [dec and proposal is not None for dec in decoding]
        feed, logit_rows, drafts = batch.feed(speculated, proposal)
        logits = self.runner.forward(batch, logit_rows, token_ids=feed, on_device=drafts)
        results = self.verifier.sample_or_verify(
            batch.seqs, logit_rows, logits, speculated, proposal
        )
        for n, verified in zip(batch.num_new_tokens, speculated):
            self.stats["decode_tokens" if n == 1 or verified else "prefill_tokens"] += n
        finished = self.scheduler.postprocess(
            batch, speculated, results, self._append, self._on_verified
        )
        seconds = time.perf_counter() - started
        # a step with a prefill chunk says nothing of decode rates
        if self.step_choice and all(decoding):
            rounds = [(r.accepted, r.drafted) for r in results if r.accepted is not None]
            self.step_choice.record(k, len(decoding), seconds, rounds)
        if self.scheduler.pacer is not None:
            prompt_tokens = sum(n for n, dec in zip(batch.num_new_tokens, decoding) if not dec)
            self.scheduler.pacer.record(sum(decoding), k, prompt_tokens, seconds)
        return finished

    def _append(self, seq: Sequence, result: StepResult) -> None:
        self.output_processor.append(seq, result.tokens, result.logprobs)

    def _on_verified(self, seq: Sequence, result: StepResult) -> None:
        if result.accepted is not None:
            self.spec_metrics.record(seq.seq_id, result.accepted, result.drafted)
        self.speculator.on_outcome(Outcome(seq, result.accepted, seq.num_computed_tokens))

    def execution(self) -> dict:
        """How this engine runs its target (engine/execution.py)."""
        return describe_execution(self)

    def close(self) -> None:
        """Stop the draft process and tensor-parallel workers (if any); the engine is unusable afterwards."""
        gc.unfreeze()  # what dies with the engine is collectable again
        if self.speculator is not None:
            self.speculator.close()
        if self.runner is not None:
            self.runner.close()
        if self._pinned is not None:
            unpin(self._pinned)
            self._pinned = None

    def to_output(self, seq: Sequence) -> RequestOutput:
        return self.output_processor.to_output(seq, self.spec_metrics.pop(seq.seq_id))
