"""Logits -> final probability rows, in vLLM / HF order: temperature (T == 0: one-hot at the raw
argmax), top-k, top-p, min-p (ties at each cut kept), softmax, in float32. q rows given to the
verifier must be exactly these rows; which branches run is decided on the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.utils.host_upload import upload


def probs_from_logits(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    *,
    filtered: bool | None = None,
    any_greedy: bool | None = None,
) -> Tensor:
    """[n, V] logits and four [n] parameter tensors -> [n, V] float32 probability rows.
    filtered: some row may use top-k, top-p or min-p; any_greedy: some row has T == 0; None reads
    them from the tensors (a GPU sync). Running a branch no row needs gives the same rows."""
    logits = logits.float()
    vocab = logits.shape[-1]
    temperature = temperature.to(logits.device, torch.float32)
    if any_greedy is None:
        any_greedy = bool((temperature == 0).any())
    # greedy rows are replaced below; dividing them by 1 keeps the arithmetic finite
    greedy = temperature == 0 if any_greedy else None
    scaled = logits / (
        torch.where(greedy, 1.0, temperature) if any_greedy else temperature
    ).unsqueeze(1)

    if filtered is False:
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


def _softmax_or_greedy(
    scaled: Tensor, logits: Tensor, greedy: Tensor | None, any_greedy: bool
) -> Tensor:
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

    cum = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1).cumsum(dim=-1)
    # first position reaching top_p; if round-off keeps the sum below it, the clamp keeps top-k's
    boundary = (cum < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
    keep &= ~p_on.unsqueeze(1) | (values >= values.gather(1, boundary))

    ratio = torch.exp(values - values[:, :1])
    keep &= ~m_on.unsqueeze(1) | (ratio >= min_p.unsqueeze(1))

    keep_original_order = torch.empty_like(keep).scatter_(1, order, keep)
    return scaled.masked_fill(~keep_original_order, float("-inf"))


@dataclass
class SamplingTensors:
    """``probs_from_logits``'s [n] float32 parameter rows and host flags (None: unknown)."""

    temperature: Tensor
    top_k: Tensor  # integers, <= 0 disabled
    top_p: Tensor
    min_p: Tensor
    filtered: bool | None = None
    any_greedy: bool | None = None

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu", times: int = 1
    ) -> SamplingTensors:
        """Each request's parameters `times` times in a row, for logits laid out [n * times, V]."""
        # float32 is exact for every enabled top-k (below the vocabulary size)
        rows = [p for p in params for _ in range(times)]
        temperature, top_k, top_p, min_p = upload(
            [
                [p.temperature for p in rows],
                [p.top_k for p in rows],
                [p.top_p for p in rows],
                [p.min_p for p in rows],
            ],
            device,
            torch.float32,
        )
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            filtered=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            any_greedy=any(p.temperature == 0 for p in params),
        )

    def probs(self, logits: Tensor) -> Tensor:
        return probs_from_logits(
            logits, *self._fields(), filtered=self.filtered, any_greedy=self.any_greedy
        )

    def _fields(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.temperature, self.top_k, self.top_p, self.min_p
