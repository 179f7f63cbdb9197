"""load_format="dummy": a model built from its folder's config.json alone, with random weights.

What must hold: nothing is read (a folder without weights loads; one without a tokenizer takes
token ids), the values are vLLM's uniform(-1e-3, 1e-3) as normal floats (no denormals: they run
far slower on x86) and the same on every build, the draft's weight formats prepare them, and the
shipped shape configs describe the models they are named after."""

import json
import os
import shutil

import pytest
import torch
from cpu_features import NEEDS_BF16
from transformers import Qwen2Config

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.config import EngineConfig
from ssd_engine.layers.linear import Linear
from ssd_engine.layers.weight_formats import Int4Weight, Int8Weight, OneDNNWeight
from ssd_engine.models.loader import DUMMY_RANGE, build_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SMALL = dict(num_kv_blocks=64, max_model_len=256)


def shape_folder(path, **overrides) -> str:
    """A folder holding config.json only: a tiny Qwen2 (vocab 320, hidden 64, 2 layers)."""
    config = Qwen2Config(
        **{
            **dict(
                vocab_size=320,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                eos_token_id=2,
                architectures=["Qwen2ForCausalLM"],
            ),
            **overrides,
        }
    )
    os.makedirs(path, exist_ok=True)
    config.to_json_file(os.path.join(path, "config.json"))
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights_are_uniform_normal_floats_and_the_same_every_build(tmp_path, dtype):
    from ssd_engine.models.loader import load_config

    config = load_config(shape_folder(tmp_path), "dummy")
    built = [
        build_model(str(tmp_path), config, 64, dtype, torch.device("cpu"), load_format="dummy")
        for _ in range(2)
    ]
    params = [dict(model.named_parameters()) for model in built]
    for name, value in params[0].items():
        assert value.dtype == dtype
        assert value.abs().max() <= DUMMY_RANGE, name
        nonzero = value[value != 0].abs()
        assert (nonzero >= torch.finfo(dtype).tiny).all(), f"{name} holds denormals"
        if value.numel() >= 64:  # random, not one constant: the matmuls read varied data
            assert value.float().std() > DUMMY_RANGE / 4, name
        assert torch.equal(value, params[1][name]), f"{name} differs between two builds"


def test_a_folder_with_config_json_alone_generates_from_token_ids(tmp_path):
    folder = shape_folder(tmp_path / "shape")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights .*load_format='dummy'"):
        LLM(folder, speculative_mode="ar")
    with LLM(folder, load_format="dummy", speculative_mode="ar", **SMALL) as llm:
        out = llm.generate([[5, 6, 7, 8], [9, 10]], GREEDY, use_tqdm=False)
        assert [len(o.token_ids) for o in out] == [6, 6]
        assert all(0 <= t < 320 for o in out for t in o.token_ids) and out[0].text == ""
        with pytest.raises(ValueError, match="has no tokenizer .* pass prompts as token ids"):
            llm.generate("def f():", GREEDY, use_tqdm=False)


def test_tokenizer_files_without_weights_load_with_dummy_and_take_text(tiny_qwen2, tmp_path):
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_qwen2, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with LLM(str(folder), load_format="dummy", speculative_mode="ar", **SMALL) as llm:
        out = llm.generate("def f():", GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 6 and isinstance(out.text, str)


@pytest.mark.parametrize(
    "fmt, prepared",
    [
        pytest.param("bf16", OneDNNWeight, marks=NEEDS_BF16),
        ("int8", Int8Weight),
        ("int4", Int4Weight),
    ],
)
def test_draft_weight_formats_prepare_dummy_weights(tmp_path, fmt, prepared):
    folder = shape_folder(tmp_path / "shape")
    with LLM(
        folder,
        draft_model=folder,
        load_format="dummy",
        speculative_mode="sd",
        num_speculative_tokens=2,
        draft_dtype=fmt,
        **SMALL,
    ) as llm:
        out = llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0]
        assert len(out.token_ids) == 6 and llm.engine.plan.draft_format.name == fmt
        layers = [m for m in llm.engine.speculator.runner.model.modules() if isinstance(m, Linear)]
        assert layers and all(isinstance(m.prepared, prepared) for m in layers)
        assert llm.speculation_metrics()["rounds"] > 0


def test_bad_load_format_is_one_clear_error():
    with pytest.raises(
        ValueError, match=r"load_format must be one of \('auto', 'dummy'\), got 'random'"
    ):
        EngineConfig.from_kwargs(load_format="random")


@pytest.mark.parametrize(
    "name, hidden, layers, heads, kv_heads, vocab, tied",
    [
        ("qwen2.5-coder-1.5b-instruct", 1536, 28, 12, 2, 151936, False),
        ("qwen2.5-coder-0.5b-instruct", 896, 24, 14, 2, 151936, False),
        ("qwen2.5-7b", 3584, 28, 28, 4, 152064, False),
    ],
)
def test_shipped_shape_configs(name, hidden, layers, heads, kv_heads, vocab, tied):
    from ssd_engine.models.loader import load_config

    folder = os.path.join(REPO, "configs", "shapes", name)
    assert sorted(os.listdir(folder)) == ["config.json"]
    config = load_config(folder, "dummy")
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
        config.tie_word_embeddings,
    ) == (hidden, layers, heads, kv_heads, vocab, tied)
    assert json.load(open(os.path.join(folder, "config.json")))["architectures"] == [
        "Qwen2ForCausalLM"
    ]
    if name == "qwen2.5-7b":
        assert (
            config.intermediate_size,
            config.rope_parameters["rope_theta"],
            config.rms_norm_eps,
        ) == (18944, 1e6, 1e-6)
