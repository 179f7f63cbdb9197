"""probs_from_logits against an independent, per-row reference written with Python lists.

The reference follows the documented order literally (temperature -> top-k -> top-p -> min-p ->
softmax) in float64 on plain lists, with no shared code. Tie rules: top-k keeps everything tied
with the k-th largest value; top-p keeps everything tied with the token at which the cumulative
probability first reaches top_p.
"""

import math
import random

import pytest
import torch

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.sampling.processors import SamplingTensors, probs_from_logits


def softmax(values: list[float]) -> list[float]:
    finite = [v for v in values if v != -math.inf]
    top = max(finite)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def reference_row(
    logits: list[float], t: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    vocab = len(logits)
    if t == 0:
        best = max(range(vocab), key=lambda i: (logits[i], -i))  # first index among ties
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    # Divide in float32, as the engine does, so ties and their order are the same.
    scaled = (
        torch.tensor(logits, dtype=torch.float32) / torch.tensor(t, dtype=torch.float32)
    ).tolist()
    keep = [True] * vocab
    if 0 < top_k < vocab:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        keep = [s >= kth for s in scaled]
    if top_p < 1:
        probs = softmax([s if k else -math.inf for s, k in zip(scaled, keep)])
        ranked = sorted(range(vocab), key=lambda i: -scaled[i])
        cumulative, boundary = 0.0, scaled[ranked[0]]
        for i in ranked:
            cumulative += probs[i]
            boundary = scaled[i]
            if cumulative >= top_p:
                break
        keep = [k and s >= boundary for k, s in zip(keep, scaled)]
    if min_p > 0:
        top = max(scaled)
        keep = [k and math.exp(s - top) >= min_p for k, s in zip(keep, scaled)]
    return softmax([s if k else -math.inf for s, k in zip(scaled, keep)])


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.8]),
        top_k=rng.choice([-1, 0, 1, 2, 5, vocab // 2, vocab, vocab + 3]),
        top_p=rng.choice([1.0, 0.05, 0.5, 0.9, 0.999]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3, 1.0]),
    )


def check_against_reference(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    probs = SamplingTensors.from_params(params).probs(logits)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for row, sp in enumerate(params):
        expected = torch.tensor(
            reference_row(logits[row].tolist(), sp.temperature, sp.top_k, sp.top_p, sp.min_p),
            dtype=torch.float64,
        )
        got = probs[row].double()
        assert torch.equal(got > 0, expected > 0), f"support differs for {sp}"
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(params)), atol=1e-5, rtol=0)
    return probs


def single(vocab: int, seed: int, rows: int, **kwargs) -> tuple[torch.Tensor, list[SamplingParams]]:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return logits, [SamplingParams(**kwargs)] * rows


@pytest.mark.parametrize("vocab", [8, 50, 1000])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.6),
        dict(temperature=1.7),
        dict(top_k=1),
        dict(top_k=3),
        dict(top_k=7),
        dict(top_p=0.3),
        dict(top_p=0.9),
        dict(min_p=0.1),
        dict(min_p=0.5),
        dict(temperature=0.5, top_k=5, top_p=0.8, min_p=0.05),
        dict(temperature=1.3, top_p=0.95, min_p=0.2),
    ],
)
def test_each_rule_matches_reference(vocab, kwargs):
    check_against_reference(*single(vocab, seed=vocab, rows=16, **kwargs))


@pytest.mark.parametrize("vocab", [8, 50, 1000])
def test_mixed_batch_matches_reference(vocab):
    rng = random.Random(vocab)
    params = [random_params(rng, vocab) for _ in range(48)]
    logits = torch.randn(48, vocab, generator=torch.Generator().manual_seed(1)) * 2.5
    check_against_reference(logits, params)


@pytest.mark.parametrize("vocab", [8, 50, 1000])
def test_ties_match_reference(vocab):
    # Logits from a handful of integers: many exact ties, including at the top-k and top-p
    # boundaries.
    rng = random.Random(100 + vocab)
    params = [random_params(rng, vocab) for _ in range(48)]
    logits = torch.randint(0, 4, (48, vocab), generator=torch.Generator().manual_seed(2)).float()
    check_against_reference(logits, params)


def test_top_k_keeps_all_tokens_tied_with_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = SamplingTensors.from_params([SamplingParams(top_k=2)]).probs(logits)
    assert (probs[0] > 0).tolist() == [True, False, True, True, True, False]


def test_top_p_keeps_top_token_and_boundary_ties():
    logits = torch.tensor([[5.0, 0.0, 0.0, -9.0]])
    probs = SamplingTensors.from_params([SamplingParams(top_p=1e-6)]).probs(logits)
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    even = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    probs = SamplingTensors.from_params([SamplingParams(top_p=0.3)]).probs(even)
    assert torch.equal(probs, torch.full((1, 4), 0.25))


@pytest.mark.parametrize("vocab", [8, 50, 1000])
def test_greedy_rows_are_one_hot_at_first_argmax(vocab):
    logits = torch.randint(0, 3, (32, vocab), generator=torch.Generator().manual_seed(3)).float()
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.3)] * 32
    probs = SamplingTensors.from_params(params).probs(logits)
    expected = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    assert torch.equal(probs, expected)


def test_fast_path_equals_plain_softmax():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(4))
    temps = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.9])
    probs = probs_from_logits(
        logits, temps, torch.tensor([-1, 0, 40, 99, -1]), torch.ones(5), torch.zeros(5)
    )
    torch.testing.assert_close(probs, torch.softmax(logits / temps[:, None], -1))


def test_disabled_top_k_values_do_not_filter():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(top_k=k) for k in (-1, 0, 20)]
    probs = SamplingTensors.from_params(params).probs(logits)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0, -math.inf], [-math.inf, 3.0, 3.0, -math.inf]])
    params = [SamplingParams(temperature=1e-3, top_p=0.9), SamplingParams(min_p=0.5)]
    probs = SamplingTensors.from_params(params).probs(logits)
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]]


def test_half_precision_input_computes_in_float32():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(top_k=10, top_p=0.9)] * 4
    probs = SamplingTensors.from_params(params).probs(logits.bfloat16())
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_repeated_rows_are_laid_out_per_position():
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(top_p=0.7)]
    rep = SamplingTensors.from_params(params, times=3)
    assert rep.temperature.tolist() == [0.5] * 3 + [1.0] * 3
    assert rep.top_k.tolist() == [3] * 3 + [-1] * 3
    assert rep.top_p.tolist() == pytest.approx([1.0] * 3 + [0.7] * 3)


def test_flags_known_on_the_host_skip_the_launches_no_row_needs():
    """Plain temperature sampling with no greedy row is a division and a softmax: two kernels on a
    GPU (tests/instrumentation/op_count.py), with the same rows as when the flags are read from the tensors."""
    from instrumentation.op_count import OpCounter

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = (
        torch.tensor([0.7, 1.0, 1.3]),
        torch.zeros(3, dtype=torch.long),
        torch.ones(3),
        torch.zeros(3),
    )
    expected = probs_from_logits(logits, *params)
    with OpCounter() as ops:
        fast = probs_from_logits(logits, *params, filtered=False, any_greedy=False)
    assert torch.equal(fast, expected)
    assert ops.total(kind="compute") == 2, ops.by("op")
