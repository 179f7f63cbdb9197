"""SD: a colocated draft model proposes K tokens per decoding sequence, autoregressively.
Each round the draft catches up (the bonus token, plus x_K after a fully accepted round), then
decodes K tokens keeping each one's exact probability row. A round's uniforms come in one draw per
request, so the K steps read nothing on the host: the round's one read is the verifier's."""

import time

import torch
import torch.nn.functional as F

from ssd_engine.core.structures import (
    BlockTable,
    Outcome,
    Proposal,
    ScheduledBatch,
    Sequence,
    new_block_table,
)
from ssd_engine.runtime.block_manager import BlockManager
from ssd_engine.runtime.model_runner import ModelRunner
from ssd_engine.sampling.grammar import Grammars, masked_steps
from ssd_engine.sampling.processors import SamplingTensors
from ssd_engine.sampling.sampler import draw_uniforms, inverse_cdf
from ssd_engine.speculative import prompt_window as windows
from ssd_engine.speculative.paged_draft import PagedDraft, StepSampler
from ssd_engine.utils.host_upload import upload

CATCH_UP_SAMPLE = 32  # tokens read in one propose before its time says what catching up costs


class DraftView:
    """The draft's side of a sequence: its own block table and how many tokens have draft K/V.
    Draft position i holds the sequence's token i below SINK, else token i + skipped."""

    def __init__(self, seq: Sequence, window: int | None = None) -> None:
        self.seq = seq
        self.block_table: BlockTable = new_block_table()
        self.num_computed_tokens = 0
        self.skipped = windows.skipped_span(seq.num_prompt_tokens, window)

    def draft_length(self, n: int) -> int:
        """Draft positions covering the sequence's first n tokens."""
        return windows.draft_length(n, self.skipped)

    def feed(self, start: int, end: int) -> list[int]:
        """The token ids at draft positions [start, end)."""
        return windows.windowed(self.seq.token_ids, self.skipped, start, end)

    def __len__(self) -> int:
        return self.draft_length(len(self.seq.token_ids))


class SyncDraft(PagedDraft[DraftView]):
    def __init__(
        self,
        runner: ModelRunner,
        num_blocks: int,
        block_size: int,
        k: int,
        proposable_vocab: int,
        generator: torch.Generator,
        grammars: Grammars | None = None,
        reads_prompts_ahead: bool = True,
        prompt_window: int | None = None,
    ) -> None:
        super().__init__(
            runner, BlockManager(num_blocks, block_size, enable_prefix_caching=False), k
        )
        self.views: dict[int, DraftView] = {}
        self.proposable_vocab = proposable_vocab
        self.generator = generator
        self.grammars = grammars
        # running average over catch-ups of CATCH_UP_SAMPLE+ tokens
        self.catch_up_s_per_token: float | None = None
        # False: read a prompt only once the draft drafts for it (engine/step_choice.py)
        self.reads_prompts_ahead = reads_prompts_ahead
        self.prompt_window = prompt_window

    def view(self, seq: Sequence) -> DraftView:
        if seq.seq_id not in self.views:
            self.views[seq.seq_id] = DraftView(seq, self.prompt_window)
        return self.views[seq.seq_id]

    def lag(self, seqs: list[Sequence]) -> int:
        """Tokens the draft must read before it can draft for every one of `seqs`."""
        views = [
            self.views[seq.seq_id]
            if seq.seq_id in self.views
            else DraftView(seq, self.prompt_window)
            for seq in seqs
        ]
        return sum(len(view) - view.num_computed_tokens for view in views)

    def release(self, seq: Sequence) -> None:
        view = self.views.pop(seq.seq_id, None)
        if view is not None:
            self.drop(view)

    def propose(self, batch: ScheduledBatch, decoding: list[bool], k: int) -> Proposal | None:
        """Catch the draft up, then draft k (<= K) tokens per decoding sequence in batch order; one
        whose draft blocks cannot be reserved gets num_draft = 0 this round."""
        extend, ends, drafting = [], [], []
        dec_views = []
        for seq, dec in zip(batch.seqs, decoding):
            if not dec and not self.reads_prompts_ahead:
                continue
            view = self.view(seq)
            if dec:
                dec_views.append(view)
            # one chunk behind the target: its first token never waits for the draft
            end = len(view) if dec else view.draft_length(seq.num_computed_tokens)
            if view.num_computed_tokens > end:  # target was preempted and recomputes: so must we
                self.drop(view)
            if not self.reserve(view, end + (k - 1 if dec else 0)):
                continue
            if end > view.num_computed_tokens:
                extend.append(view)
                ends.append(end)
            if dec:
                drafting.append(view)
        started, read = (
            time.perf_counter(),
            sum(end - v.num_computed_tokens for v, end in zip(extend, ends)),
        )
        logits = self._extend(extend, ends, drafting)
        if read >= CATCH_UP_SAMPLE:
            per_token = (time.perf_counter() - started) / read
            before = self.catch_up_s_per_token
            # a first catch-up can carry one-time costs (kernel compiles on a GPU): a sample under a
            # quarter of the estimate replaces it, others are averaged in
            self.catch_up_s_per_token = (
                per_token
                if before is None or per_token < before / 4
                else 0.5 * (before + per_token)
            )
        if not dec_views:
            return None
        device, vocab = self.runner.device, self.runner.config.vocab_size
        num_draft = torch.tensor([k if v in drafting else 0 for v in dec_views])
        greedy = all(v.seq.params.greedy for v in dec_views)
        if len(drafting) == len(dec_views):
            tokens, drawn_probs = self._draft(drafting, logits, greedy, k)
            probs = None if greedy else F.pad(drawn_probs, (0, vocab - drawn_probs.shape[-1]))
            return Proposal(tokens, probs, num_draft)
        tokens = torch.zeros(len(dec_views), k, dtype=torch.long, device=device)
        probs = None if greedy else torch.zeros(len(dec_views), k, vocab, device=device)
        if drafting:
            # queued work keeps running
            (rows,) = upload([[dec_views.index(v) for v in drafting]], device)
            drawn_tokens, drawn_probs = self._draft(drafting, logits, greedy, k)
            tokens[rows] = drawn_tokens
            if probs is not None:
                probs[rows, :, : drawn_probs.shape[-1]] = drawn_probs
        return Proposal(tokens, probs, num_draft)

    def _draft(self, views: list[DraftView], logits: torch.Tensor, greedy: bool, k: int):
        """k autoregressive draft steps from the catch-up logits; returns tokens [n, k] and the
        exact rows they were sampled from [n, k, proposable_vocab] (None when greedy)."""
        states = self.grammars.states([v.seq for v in views]) if self.grammars is not None else []
        with masked_steps(states, self._sampler(views, greedy, k)) as sampler:
            tokens, rows = self.decode(views, [len(v) for v in views], logits, sampler, k)
        for view in views:
            view.num_computed_tokens = len(view) + k - 1
        return tokens, rows

    def _sampler(self, views: list[DraftView], greedy: bool, k: int) -> StepSampler:
        vocab = self.proposable_vocab
        if greedy:
            return lambda step, logits: (logits[:, :vocab].argmax(dim=-1), None)
        params = [v.seq.params for v in views]
        sampling = SamplingTensors.from_params(params, self.runner.device)
        # each random row's K uniforms in one draw from its draft stream: one call a round
        u = draw_uniforms(
            [v.seq.draft_generator for v in views],
            [k if not p.greedy else 0 for p in params],
            k,
            self.runner.device,
            self.generator,
        )

        def draw(step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            probs = sampling.probs(logits[:, :vocab])
            # a one-hot (greedy) row's u = 0 picks its token
            return inverse_cdf(probs, u[:, step]), probs

        return draw

    def _extend(
        self, views: list[DraftView], ends: list[int], drafting: list[DraftView]
    ) -> torch.Tensor:
        """Compute draft KV for views[i] up to ends[i]; return the last position's logits of
        each drafting view, in `drafting` order."""
        if not views:
            return torch.empty(0)
        wanted = {id(v) for v in drafting}
        rows = [1 if id(v) in wanted else 0 for v in views]
        logits = self.extend_kv(
            views,
            [v.num_computed_tokens for v in views],
            [v.feed(v.num_computed_tokens, end) for v, end in zip(views, ends)],
            rows,
        )
        for view, end in zip(views, ends):
            view.num_computed_tokens = end
        row_of = {id(v): j for j, v in enumerate(v for v, n in zip(views, rows) if n)}
        if not drafting:
            return logits
        # a list index would cross blocking
        (index,) = upload([[row_of[id(v)] for v in drafting]], logits.device)
        return logits[index]

    def on_outcome(self, outcome: Outcome) -> None:
        """After verification: the draft KV is valid up to the accepted prefix of the sequence."""
        view = self.views.get(outcome.seq.seq_id)
        if view is not None:
            view.num_computed_tokens = min(
                view.num_computed_tokens, view.draft_length(outcome.num_kept)
            )
            self.blocks.trim(view)

    def summary(self) -> dict:
        return {}  # SD's acceptance metrics are the engine's own

    def close(self) -> None:
        """Nothing runs beside the engine: the draft model lives in this process."""
