"""SamplingParams: defaults, validation messages, normalisation."""

import math

import pytest

from ssd_engine.core.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.seed, p.max_tokens, p.ignore_eos) == (None, 16, False)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", True),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert "\n" not in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_minus_one_and_zero_both_disable(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k


def test_boundary_values_are_valid():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, seed=0, max_tokens=1)
    SamplingParams(top_p=1e-6, min_p=0.0, seed=-5)


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_stop_lists_are_copied():
    stop, ids = ["x"], [1]
    p = SamplingParams(stop=stop, stop_token_ids=ids)
    stop.append("y")
    ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
