"""One step's logits -> each scheduled sequence's new tokens: sample, or verify a speculation.
The only device-to-host read is the emitted tokens, once a step."""

from dataclasses import dataclass

import torch

from ssd_engine.core.structures import Proposal, Sequence
from ssd_engine.sampling.grammar import Grammars
from ssd_engine.sampling.logprobs import emitted_logprobs
from ssd_engine.sampling.penalties import adjusted
from ssd_engine.sampling.processors import SamplingTensors
from ssd_engine.sampling.rejection import verify, verify_greedy
from ssd_engine.sampling.sampler import sample
from ssd_engine.sampling.synthetic import BernoulliDraws, verify_synthetic
from ssd_engine.utils.host_upload import upload


@dataclass
class StepResult:
    tokens: list[int] | None  # emitted this step (None: a prefill chunk short of the end)
    accepted: int | None = None  # drafts accepted, for a verified speculation with drafts
    drafted: int | None = None  # its drafts (the step's K), where `accepted` is given
    logprobs: list[dict[int, float]] | None = None  # per emitted token, where the request asked


class Verifier:
    def __init__(
        self,
        generator: torch.Generator,
        synthetic: BernoulliDraws | None = None,
        eos_token_ids: set[int] | frozenset = frozenset(),
        grammars: Grammars | None = None,
    ) -> None:
        self.generator = generator  # unseeded requests' stream
        self.synthetic = synthetic
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back
        self.grammars = grammars  # None: structured outputs refused

    def processed(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each row's history-dependent law (row j after drafts[:, :j]): penalties, then grammar."""
        logits = adjusted(logits, seqs, self.eos_token_ids, drafts)
        if self.grammars is None or not any(seq.params.structured_outputs for seq in seqs):
            return logits
        return self.grammars.masked(logits, seqs, drafts.tolist() if drafts is not None else None)

    def sample_or_verify(
        self,
        seqs: list[Sequence],
        logit_rows: list[list[int]],
        logits: torch.Tensor,
        speculated: list[bool],
        proposal: Proposal | None,
    ) -> list[StepResult]:
        out = [StepResult(None) for _ in seqs]
        first_row = [0]
        for rows in logit_rows:
            first_row.append(first_row[-1] + len(rows))
        plain = [i for i, rows in enumerate(logit_rows) if rows and not speculated[i]]
        speculated_rows = [i for i, s in enumerate(speculated) if s]
        picks = [
            [first_row[i] for i in plain],
            [r for i in speculated_rows for r in range(first_row[i], first_row[i + 1])],
        ]
        plain_seqs, spec_seqs = [seqs[i] for i in plain], [seqs[i] for i in speculated_rows]
        plain_logits, spec_logits = _rows(logits, picks)
        # each row's law after its own history, once, for sampling, verification and logprobs
        plain_laws = self.processed(plain_logits, plain_seqs) if plain else None
        spec_laws = (
            self.processed(spec_logits, spec_seqs, proposal.tokens) if speculated_rows else None
        )
        # sampling first, then verification: the order the requests' random streams are drawn in
        sampled = self._sample(plain_seqs, plain_laws) if plain else None
        result = None
        if speculated_rows:
            result = (
                verify_synthetic(proposal, spec_logits, self.synthetic)
                if self.synthetic is not None
                else self._verify(spec_seqs, proposal, spec_laws)
            )
        if sampled is not None:
            sampled_tokens = result.read_with(sampled) if result is not None else sampled.tolist()
            for i, token in zip(plain, sampled_tokens):
                out[i] = StepResult([token])
        if result is not None:
            drafted = proposal.num_draft.tolist()  # a host tensor: the proposer knows its counts
            for j, i in enumerate(speculated_rows):
                tokens = result.output_tokens[j]
                if drafted[j] > 0:
                    out[i] = StepResult(tokens, len(tokens) - 1, drafted[j])
                else:
                    out[i] = StepResult(tokens)
        for i, seq in enumerate(seqs):  # only requests that asked: each costs a read of its rows
            if seq.params.logprobs is not None and out[i].tokens:
                if speculated[i]:
                    start = speculated_rows.index(i) * (proposal.k + 1)
                    rows = spec_laws[start : start + len(out[i].tokens)]
                else:
                    rows = plain_laws[plain.index(i)][None]
                out[i].logprobs = emitted_logprobs(seq, rows, out[i].tokens)
        return out

    def _verify(self, seqs: list[Sequence], proposal: Proposal, target_laws: torch.Tensor):
        """Exact verification of each sequence's K drafts against its K + 1 `processed` rows."""
        k = proposal.k
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            return verify_greedy(
                proposal.tokens,
                target_laws.argmax(dim=-1).view(len(seqs), k + 1),
                proposal.num_draft,
            )
        probs = SamplingTensors.from_params(params, target_laws.device, times=k + 1).probs(
            target_laws
        )
        return verify(
            proposal.tokens,
            proposal.probs,
            probs.view(len(seqs), k + 1, -1),
            [s.generator for s in seqs],
            num_draft=proposal.num_draft,
            default_generator=self.generator,
            one_hot_rows=proposal.one_hot,
            random_rows=[not p.greedy for p in params],
        )

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        return self._sample(seqs, self.processed(logits, seqs))

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """One token per sequence from its row, already processed (`processed`)."""
        params = [seq.params for seq in seqs]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)
        probs = SamplingTensors.from_params(params, logits.device).probs(logits)
        return sample(
            probs,
            [seq.generator for seq in seqs],
            self.generator,
            random_rows=[not p.greedy for p in params],
        )


def _rows(logits: torch.Tensor, picks: list[list[int]]) -> list[torch.Tensor]:
    """logits[rows] per list (every row in order: logits itself); indices go up in one copy."""
    whole = list(range(logits.shape[0]))
    if any(rows == whole for rows in picks):
        return [
            logits if rows == whole else logits[:0] for rows in picks
        ]  # the other list is empty
    return [logits[index] for index in upload(picks, logits.device)]
