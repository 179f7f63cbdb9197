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


def test_from_optional_fills_what_is_unset_from_the_defaults():
    defaults = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05)
    p = SamplingParams.from_optional(
        defaults, temperature=None, top_p=0.5, top_k=None, seed=3, max_tokens=9, stop=None
    )
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens, p.stop) == (
        0.7,
        0.5,
        20,
        0.05,
        3,
        9,
        [],
    )
    assert SamplingParams.from_optional(defaults, temperature=0).greedy  # 0 is a value, not unset
    assert SamplingParams.from_optional(None, temperature=None, max_tokens=None) == SamplingParams()


def _folder_with(tmp_path, name: str, generation_config: dict | None) -> str:
    import json

    folder = tmp_path / name
    folder.mkdir()
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return str(folder)


def test_model_defaults_are_the_sampling_fields_generation_config_sets(tmp_path):
    """vLLM's rule: temperature / top_p / top_k / min_p / repetition_penalty where the file sets them; do_sample and the other
    fields are ignored, so a file with `do_sample: false` alone, or no file, sets nothing."""
    from ssd_engine.core.sampling_params import model_sampling_defaults

    assert model_sampling_defaults(_folder_with(tmp_path, "none", None)) == {}
    assert (
        model_sampling_defaults(
            _folder_with(tmp_path, "greedy_flag", {"do_sample": False, "eos_token_id": 2})
        )
        == {}
    )
    sampled = {
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_new_tokens": 99,
        "eos_token_id": 2,
    }
    assert model_sampling_defaults(_folder_with(tmp_path, "sampled", sampled)) == dict(
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1
    )
    assert model_sampling_defaults(_folder_with(tmp_path, "min_p", {"min_p": 0.05})) == {
        "min_p": 0.05
    }


def test_a_model_default_no_request_could_take_names_the_file_and_field(tmp_path):
    from ssd_engine.core.sampling_params import model_sampling_defaults

    folder = _folder_with(tmp_path, "bad", {"do_sample": True, "top_p": 1.5})
    with pytest.raises(ValueError, match="top_p") as info:
        model_sampling_defaults(folder)
    assert "generation_config.json" in str(info.value) and "\n" not in str(info.value)
