"""Structured outputs: the grammar's mask on the target's law, exact under SD and SSD (xgrammar).

A grammar makes a position's law depend on the tokens before it, like a penalty: tokens the grammar
forbids after them get probability 0 and the rest renormalise. Under SD and SSD verification row j
follows the sequence's tokens and the first j drafts, so its mask is the matcher's after those: the
matcher advances over the drafts one by one, fills each row's mask, and rolls back. Rejection
sampling against the masked rows then emits exactly the masked target law; a draft the grammar
forbids has probability 0 there and is always rejected. The draft may mask its own rows too (SD
does, `DraftMasks`): that only raises acceptance, since its q rows stay the rows it sampled from.

Why xgrammar rather than llguidance: on the default pair's 152k-token vocabulary a JSON-schema
token's mask plus advance took 0.02 ms against llguidance's 0.32 (measured here, 2026-11-26), and
SD fills K + 1 masks a round. Grammars are compiled once per distinct spec and cached.

A sequence's matcher is caught up lazily with its output tokens before each use, so the engine
loop never tells it what was emitted. Once the grammar has ended, end-of-sequence is the only token.
"""
from __future__ import annotations

import json
import logging
import threading

import torch
from torch import Tensor

from ssd_engine.core.structured_outputs import StructuredOutputsParams
from ssd_engine.core.structures import Sequence

log = logging.getLogger("ssd_engine")
# JSON may put this many whitespace characters in a row, no more: a model that prefers whitespace inside a
# JSON grammar (a known failure of unbounded whitespace) cannot pad its output to max_tokens
MAX_WHITESPACE = 16


class _Matcher:
    """One sequence's grammar state: the matcher after its first `consumed` output tokens."""

    def __init__(self, matcher) -> None:
        self.matcher, self.consumed, self.broken = matcher, 0, False

    def catch_up(self, outputs: list[int]) -> None:
        for token in outputs[self.consumed:]:
            if not self.broken and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                log.error("grammar refused emitted token %d; the rest of this output is end-of-sequence", token)
                self.broken = True
        self.consumed = len(outputs)

    def advance(self, token: int) -> bool:
        """Take one draft token; False (and no change) where the grammar forbids it."""
        return not self.broken and not self.matcher.is_terminated() and self.matcher.accept_token(token)


class Grammars:
    """Compiled grammars (cached by spec) and each structured request's matcher, for one engine."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._compiler = None  # built on the first structured request (~1 s for a 152k vocabulary)
        self._compiled: dict[tuple, object] = {}
        self._matchers: dict[int, _Matcher] = {}
        self._lock = threading.Lock()  # the server compiles on its event loop while the engine steps

    def compile(self, spec: StructuredOutputsParams):
        """The spec's compiled grammar; a ValueError naming the field where it does not compile."""
        with self._lock:
            if spec.key not in self._compiled:
                self._compiled[spec.key] = self._compile(spec)
            return self._compiled[spec.key]

    def _compile(self, spec: StructuredOutputsParams):
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError("structured_outputs needs xgrammar: pip install 'ssd_engine[structured]'") from None
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiler = self._compiler
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.json if spec.kind == "json" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as error:  # xgrammar raises RuntimeError / ValueError with multi-line text
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: {first}") from None

    def _matcher(self, seq: Sequence) -> _Matcher:
        state = self._matchers.get(seq.seq_id)
        if state is None:
            import xgrammar as xgr
            state = _Matcher(xgr.GrammarMatcher(self.compile(seq.params.structured_outputs)))
            self._matchers[seq.seq_id] = state
        state.catch_up(seq.output_token_ids)
        return state

    def release(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)

    def masked(self, logits: Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> Tensor:
        """logits [len(seqs) * rows, V]: row j of sequence i is masked by its grammar after its output so
        far and drafts[i][:j]. `logits` itself when no sequence is structured."""
        if not any(seq.params.structured_outputs for seq in seqs):
            return logits
        rows = logits.shape[0] // len(seqs)
        allowed = torch.ones(len(seqs), rows, logits.shape[-1], dtype=torch.bool)
        for i, seq in enumerate(seqs):
            if seq.params.structured_outputs:
                allowed[i] = self._allowed_along(seq, drafts[i][:rows - 1] if drafts is not None else [], rows)
        allowed = allowed.view(-1, logits.shape[-1]).to(logits.device)
        return logits.float().masked_fill(~allowed, float("-inf"))

    def _allowed_along(self, seq: Sequence, drafts: list[int], rows: int) -> Tensor:
        """[rows, V] bool: the grammar's allowed tokens after the output and each prefix of `drafts`."""
        state = self._matcher(seq)
        out = torch.empty(rows, self.vocab_size, dtype=torch.bool)
        taken = 0
        for j in range(rows):
            out[j] = self._allowed_now(state)
            if j == rows - 1 or j >= len(drafts) or not state.advance(drafts[j]):
                out[j + 1:] = out[j]  # past a forbidden draft: rows verification never reaches
                break
            taken += 1
        if taken:
            state.matcher.rollback(taken)
        return out

    def _allowed_now(self, state: _Matcher) -> Tensor:
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        if state.broken or state.matcher.is_terminated():
            allowed[self.eos_token_ids] = True
            return allowed
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        state.matcher.fill_next_token_bitmask(bitmask)
        return unpack(bitmask[0], self.vocab_size)

    def draft_masks(self, seqs: list[Sequence]) -> DraftMasks | None:
        """A draft's step-by-step masks for these sequences (None: none is structured)."""
        if not any(seq.params.structured_outputs for seq in seqs):
            return None
        return DraftMasks(self, seqs)


class DraftMasks:
    """Masks for K autoregressive draft steps: step s's row is the grammar's after the output and the
    s tokens drafted before it; `done()` rolls every matcher back to the committed output."""

    def __init__(self, grammars: Grammars, seqs: list[Sequence]) -> None:
        self.grammars = grammars
        self.states = [grammars._matcher(s) if s.params.structured_outputs else None for s in seqs]
        self.taken = [0] * len(seqs)
        self.alive = [True] * len(seqs)  # False once a draft left the grammar: later steps are not verified

    def apply(self, logits: Tensor) -> Tensor:
        """logits [len(seqs), >= V'] of this step, masked where structured (columns past V untouched)."""
        allowed = torch.ones(logits.shape[0], logits.shape[-1], dtype=torch.bool)
        vocab = min(logits.shape[-1], self.grammars.vocab_size)
        for i, state in enumerate(self.states):
            if state is not None and self.alive[i]:
                allowed[i, :vocab] = self.grammars._allowed_now(state)[:vocab]
        return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))

    def took(self, tokens: Tensor) -> None:
        """Advance each structured sequence's matcher over the token it drafted this step."""
        host = tokens.tolist()
        for i, state in enumerate(self.states):
            if state is not None and self.alive[i]:
                if state.advance(host[i]):
                    self.taken[i] += 1
                else:
                    self.alive[i] = False

    def done(self) -> None:
        for state, taken in zip(self.states, self.taken):
            if state is not None and taken:
                state.matcher.rollback(taken)


_BITS = None


def unpack(bitmask: Tensor, vocab_size: int) -> Tensor:
    """xgrammar's int32 bitmask (bit b of word w: token 32 w + b allowed) -> [vocab_size] bool."""
    global _BITS
    if _BITS is None:
        _BITS = torch.arange(32, dtype=torch.int32)
    return ((bitmask[:, None] >> _BITS) & 1).view(-1)[:vocab_size].bool()
