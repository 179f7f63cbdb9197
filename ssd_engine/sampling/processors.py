"""Logits -> final probability rows: the one place where sampling parameters act.

Order (the same as vLLM / Hugging Face):

1. temperature: divide the logits by T. Rows with T == 0 (greedy) become one-hot at
   ``torch.argmax`` of the raw logits (first index among ties). That makes greedy a special
   case of the stochastic rules: sampling a one-hot row returns the argmax, and verifying
   one-hot p against one-hot q accepts exactly when they agree.
2. top-k: keep every token whose scaled logit is >= the k-th largest. Tokens tied with the
   k-th value are all kept (as in HF), so the result never depends on sort order among ties.
   k <= 0 or k >= V means disabled.
3. top-p: on the distribution left by top-k, find the first token (in descending order) at
   which the cumulative probability reaches top_p, and keep every token whose logit is >= that
   token's (again: ties at the boundary are kept). The top token is always kept. 1 = disabled.
4. min-p: drop tokens whose probability is < min_p * (top token's probability). The ratio does
   not change under renormalisation, so it is computed as exp(logit - max logit). 0 = disabled.
5. softmax over the survivors (masked logits are -inf), which renormalises.

Everything is computed in float32 on the logits' device. Rows sent to the verifier as q must be
exactly these rows (docs/saguaro.md "Exact verification").

Which branches run (any filter on? any greedy row?) is decided on the host from the sampling
parameters (`SamplingTensors.from_params`), never by reading the parameter tensors back: on a GPU
such a read waits for every queued kernel (tests/instrumentation/sync_count.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.utils.host_upload import upload


def probs_from_logits(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, *,
    filtered: bool | None = None, any_greedy: bool | None = None,
) -> Tensor:
    """[n, V] logits and four [n] parameter tensors -> [n, V] float32 probability rows.

    filtered: some row may use top-k, top-p or min-p; any_greedy: some row has T == 0. Both are
    known on the host where the parameters are; None reads them from the tensors (a host sync on a
    GPU). Running a branch no row needs gives the same rows, only slower: an off filter keeps
    every token, and non-greedy rows keep their softmax.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    temperature = temperature.to(logits.device, torch.float32)
    if any_greedy is None:
        any_greedy = bool((temperature == 0).any())
    # Greedy rows are replaced below; dividing them by 1 just keeps the arithmetic finite. Without
    # greedy rows the divisor is the temperature itself (the same quotients, launches fewer).
    greedy = temperature == 0 if any_greedy else None
    scaled = logits / (torch.where(greedy, 1.0, temperature) if any_greedy else temperature).unsqueeze(1)

    if filtered is False:  # plain temperature sampling: no filter's mask, no sort
        return _softmax_or_greedy(scaled, logits, greedy, any_greedy)
    top_k = top_k.to(logits.device, torch.int64)
    top_p = top_p.to(logits.device, torch.float32)
    min_p = min_p.to(logits.device, torch.float32)
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1
    m_on = min_p > 0
    if filtered is None:
        filtered = bool((k_on | p_on | m_on).any())
    if filtered:
        scaled = _mask_filtered(scaled, torch.where(k_on, top_k, vocab), top_p, p_on, min_p, m_on)
    return _softmax_or_greedy(scaled, logits, greedy, any_greedy)


def _softmax_or_greedy(scaled: Tensor, logits: Tensor, greedy: Tensor | None, any_greedy: bool) -> Tensor:
    """softmax of the scaled rows; greedy rows one-hot at the raw logits' argmax."""
    probs = torch.softmax(scaled, dim=-1)
    if any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def _mask_filtered(
    scaled: Tensor, k: Tensor, top_p: Tensor, p_on: Tensor, min_p: Tensor, m_on: Tensor
) -> Tensor:
    """Set the logits removed by top-k, top-p and min-p to -inf (one sort for all three)."""
    vocab = scaled.shape[-1]
    values, order = scaled.sort(dim=-1, descending=True)

    kth = values.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1))
    keep = values >= kth

    # top-p acts on the distribution that top-k left behind.
    cum = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1).cumsum(dim=-1)
    # Index of the first position whose cumulative probability reaches top_p. If round-off keeps
    # the sum just below top_p, the clamp keeps everything top-k kept, which is the right limit.
    boundary = (cum < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
    keep &= ~p_on.unsqueeze(1) | (values >= values.gather(1, boundary))

    ratio = torch.exp(values - values[:, :1])
    keep &= ~m_on.unsqueeze(1) | (ratio >= min_p.unsqueeze(1))

    keep_original_order = torch.empty_like(keep).scatter_(1, order, keep)
    return scaled.masked_fill(~keep_original_order, float("-inf"))


@dataclass
class SamplingTensors:
    """The per-row parameter tensors that ``probs_from_logits`` takes, and what the host knows of
    them (None: unknown, read from the tensors)."""

    temperature: Tensor  # [n] float32
    top_k: Tensor  # [n] float32 holding integers, <= 0 disabled (probs_from_logits casts it if a filter is on)
    top_p: Tensor  # [n] float32
    min_p: Tensor  # [n] float32
    filtered: bool | None = None    # some row has top-k, top-p or min-p on
    any_greedy: bool | None = None  # some row has T == 0

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu", times: int = 1
    ) -> SamplingTensors:
        """Each request's parameters `times` times in a row, for logits laid out [n * times, V] (a
        verification's K + 1 positions per sequence): repeated on the host, so the rows cross to the
        device in one copy (utils/host_upload.py) and nothing is repeated or cast there."""
        # float32: each float rounds as a float32 tensor made from it would, and every top-k that is
        # not disabled (below the vocabulary's size) is exact in it; a huge one rounds to a huge one,
        # disabled all the same
        rows = [p for p in params for _ in range(times)]
        temperature, top_k, top_p, min_p = upload([[p.temperature for p in rows], [p.top_k for p in rows],
                                                   [p.top_p for p in rows], [p.min_p for p in rows]],
                                                  device, torch.float32)
        return cls(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            filtered=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            any_greedy=any(p.temperature == 0 for p in params),
        )

    def probs(self, logits: Tensor) -> Tensor:
        return probs_from_logits(logits, *self._fields(), filtered=self.filtered, any_greedy=self.any_greedy)

    def _fields(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.temperature, self.top_k, self.top_p, self.min_p
