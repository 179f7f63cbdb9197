"""Structured outputs (xgrammar): verification row j is masked by the matcher after the first j
drafts, so rejection sampling emits exactly the masked target law under SD and SSD."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from contextlib import contextmanager

import torch
from torch import Tensor

from ssd_engine.core.structured_outputs import StructuredOutputsParams
from ssd_engine.core.structures import Sequence

log = logging.getLogger("ssd_engine")
# most whitespace characters in a row in JSON: a model cannot pad its output to max_tokens
MAX_WHITESPACE = 16
COMPILED_KEPT = 256


class GrammarState:
    """One sequence's grammar matcher after its first `consumed` output tokens (or a fork of it)."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.matcher, self.vocab_size, self.eos_token_ids = matcher, vocab_size, eos_token_ids
        self.consumed, self.broken = 0, False

    def catch_up(self, outputs: list[int]) -> None:
        for token in outputs[self.consumed :]:
            if (
                not self.broken
                and not self.matcher.is_terminated()
                and not self.matcher.accept_token(token)
            ):
                log.error(
                    "grammar refused emitted token %d; the rest of this output is end-of-sequence",
                    token,
                )
                self.broken = True
        self.consumed = len(outputs)

    def advance(self, token: int) -> bool:
        """Take one draft token; False (and no change) where the grammar forbids it."""
        return (
            not self.broken
            and not self.matcher.is_terminated()
            and self.matcher.accept_token(token)
        )

    def rollback(self, count: int) -> None:
        if count:
            self.matcher.rollback(count)

    def fork(self) -> GrammarState:
        twin = GrammarState(self.matcher.fork(), self.vocab_size, self.eos_token_ids)
        twin.consumed, twin.broken = self.consumed, self.broken
        return twin

    def allowed(self) -> Tensor:
        """[vocab_size] bool: the tokens the grammar allows next (after its end: end-of-sequence only)."""
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        if self.broken or self.matcher.is_terminated():
            # a model without an end token: nothing to force
            allowed[self.eos_token_ids or slice(None)] = True
            return allowed
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        return unpack(bitmask[0], self.vocab_size)

    def along(self, drafts: list[int], rows: int) -> tuple[Tensor, int]:
        """([rows, V] allowed after each drafts[:j], rows reachable: a forbidden draft ends it)."""
        out = torch.empty(rows, self.vocab_size, dtype=torch.bool)
        taken = 0
        for j in range(rows):
            out[j] = self.allowed()
            if j == rows - 1 or j >= len(drafts) or not self.advance(drafts[j]):
                out[j + 1 :] = out[j]
                break
            taken += 1
        self.rollback(taken)
        return out, taken + 1


class Grammars:
    """Compiled grammars (cached by spec) and each structured request's matcher, for one engine."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = (
            tokenizer,
            vocab_size,
            sorted(eos_token_ids),
        )
        self._compiler = None
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._states: dict[int, GrammarState] = {}
        # the server compiles on its event loop while the engine steps
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams):
        """The spec's compiled grammar; a ValueError naming the field where it does not compile."""
        with self._lock:
            if spec.key not in self._compiled:
                self._compiled[spec.key] = self._compile(spec)
                if len(self._compiled) > COMPILED_KEPT:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec.key)
            return self._compiled[spec.key]

    def _compile(self, spec: StructuredOutputsParams):
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError(
                "structured_outputs needs xgrammar: pip install 'ssd_engine[structured]'"
            ) from None
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self.eos_token_ids or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiler = self._compiler
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.json if spec.kind == "json" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in spec.choice)
                )
            return compiler.compile_grammar(spec.grammar)
        except Exception as error:  # xgrammar raises RuntimeError / ValueError with multi-line text
            first = (
                str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            )
            # xgrammar's "[time] file.cc:line: " prefix
            first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: {first}") from None

    def state(self, key: int, spec: StructuredOutputsParams, outputs: list[int]) -> GrammarState:
        """The grammar state of request `key` (made on first use) caught up with its `outputs`."""
        state = self._states.get(key)
        if state is None:
            import xgrammar as xgr

            state = GrammarState(
                xgr.GrammarMatcher(self.compile(spec)), self.vocab_size, self.eos_token_ids
            )
            self._states[key] = state
        state.catch_up(outputs)
        return state

    def _of(self, seq: Sequence) -> GrammarState:
        return self.state(seq.seq_id, seq.params.structured_outputs, seq.output_token_ids)

    def release(self, seq: Sequence) -> None:
        self.forget(seq.seq_id)

    def forget(self, key: int) -> None:
        self._states.pop(key, None)

    def masked(
        self, logits: Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None
    ) -> Tensor:
        """logits [len(seqs) * rows, V]: row j of seqs[i] masked after drafts[i][:j], or as is."""
        if not any(seq.params.structured_outputs for seq in seqs):
            return logits
        rows = logits.shape[0] // len(seqs)
        allowed = torch.ones(len(seqs), rows, logits.shape[-1], dtype=torch.bool)
        for i, seq in enumerate(seqs):
            if seq.params.structured_outputs:
                allowed[i], _ = self._of(seq).along(
                    drafts[i][: rows - 1] if drafts is not None else [], rows
                )
        allowed = allowed.view(-1, logits.shape[-1]).to(logits.device)
        return logits.float().masked_fill(~allowed, float("-inf"))

    def states(self, seqs: list[Sequence]) -> list[GrammarState | None]:
        """Each sequence's grammar state caught up with its output (None: not structured)."""
        return [self._of(s) if s.params.structured_outputs else None for s in seqs]


@contextmanager
def masked_steps(states: list[GrammarState | None], sampler):
    """`sampler` masked where a state is given (states rolled back after); else `sampler` itself."""
    if not any(state is not None for state in states):
        yield sampler
        return
    masks = DraftMasks(states)
    try:
        yield masks.wrap(sampler)
    finally:
        masks.done()


class DraftMasks:
    """Masks for K draft steps, one state per row (None: unstructured); `done()` rolls them back."""

    def __init__(self, states: list[GrammarState | None]) -> None:
        self.states = states
        self.taken = [0] * len(states)
        # False once a draft left the grammar: later steps are not verified
        self.alive = [True] * len(states)

    def apply(self, logits: Tensor) -> Tensor:
        """logits [len(states), V'] of this step, masked where structured (columns past the grammar's V kept)."""
        allowed = torch.ones(logits.shape[0], logits.shape[-1], dtype=torch.bool)
        for i, state in enumerate(self.states):
            if state is not None and self.alive[i]:
                vocab = min(logits.shape[-1], state.vocab_size)
                allowed[i, :vocab] = state.allowed()[:vocab]
        return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))

    def took(self, tokens: Tensor) -> None:
        host = tokens.tolist()
        for i, state in enumerate(self.states):
            if state is not None and self.alive[i]:
                if state.advance(host[i]):
                    self.taken[i] += 1
                else:
                    self.alive[i] = False

    def done(self) -> None:
        for state, taken in zip(self.states, self.taken):
            if state is not None:
                state.rollback(taken)

    def wrap(self, sampler):
        """Step sampler (step, logits) -> (tokens, q rows) that masks first; q rows are masked."""

        def masked(step: int, logits: Tensor):
            drawn, q = sampler(step, self.apply(logits))
            self.took(drawn)
            return drawn, q

        return masked


_BITS = None


def unpack(bitmask: Tensor, vocab_size: int) -> Tensor:
    """xgrammar's int32 bitmask (bit b of word w: token 32 w + b allowed) -> [vocab_size] bool."""
    global _BITS
    if _BITS is None:
        _BITS = torch.arange(32, dtype=torch.int32)
    return ((bitmask[:, None] >> _BITS) & 1).view(-1)[:vocab_size].bool()
