"""The streaming GGUF converter: the same bytes save_pretrained would write, in bounded memory.

A synthetic GGUF (written with gguf's own writer, quantized with its own quantizer) stands in for
the real parts; the slow test converts the real SmolLM2 fixture and compares every tensor with
transformers' own GGUF dequantization.
"""

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="converting a GGUF needs the gguf package")

from ssd_engine.models import gguf_stream  # noqa: E402


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, "gguf.GGMLQuantizationType"]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, qtype) in tensors.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def plans_for(reader, names: dict[str, str], row_orders: dict[str, np.ndarray] | None = None):
    plans = []
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        plans.append(
            gguf_stream.TensorPlan(
                names[tensor.name], tensor.name, shape, (row_orders or {}).get(tensor.name)
            )
        )
    return sorted(plans, key=lambda p: p.hf_name)


@pytest.fixture
def synthetic(tmp_path):
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = {
        "blk.0.attn_q.weight": (rng.standard_normal((64, 96), dtype=np.float32), q8),
        "token_embd.weight": (rng.standard_normal((300, 64), dtype=np.float32), q8),
        "blk.0.attn_norm.weight": (
            rng.standard_normal(64, dtype=np.float32),
            gguf.GGMLQuantizationType.F32,
        ),
    }
    path = tmp_path / "synthetic.gguf"
    write_gguf(path, tensors)
    names = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    }
    return path, names


def test_chunked_output_is_what_safetensors_writes(synthetic, tmp_path):
    from safetensors.torch import save_file

    path, names = synthetic
    reader = gguf.GGUFReader(str(path))
    plans = plans_for(reader, names)
    ours = tmp_path / "ours.safetensors"
    gguf_stream.write_safetensors(
        path, reader, plans, ours, chunk_bytes=1000
    )  # a few rows per chunk
    whole = {
        names[t.name]: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        for t in reader.tensors
    }
    theirs = tmp_path / "theirs.safetensors"
    save_file(whole, str(theirs), metadata={"format": "pt"})
    assert ours.read_bytes() == theirs.read_bytes()


def test_llama_qk_rows_are_unpermuted(synthetic, tmp_path):
    """GGUF interleaves the rotary halves of each head's q/k rows; Hugging Face keeps them apart."""
    from safetensors import safe_open

    path, names = synthetic
    reader = gguf.GGUFReader(str(path))
    heads = 4
    order = gguf_stream._unpermute_rows(64, heads)
    plans = plans_for(reader, names, {"blk.0.attn_q.weight": order})
    out = tmp_path / "out.safetensors"
    gguf_stream.write_safetensors(path, reader, plans, out, chunk_bytes=700)
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    dense = gguf.quants.dequantize(stored.data, stored.tensor_type)
    # llama.cpp's permutation undone the way its converter describes it: per head (dim/2, 2) -> (2, dim/2)
    expected = dense.reshape(heads, 64 // heads // 2, 2, 96).swapaxes(1, 2).reshape(64, 96)
    with safe_open(str(out), "pt") as f:
        assert np.array_equal(
            f.get_tensor("model.layers.0.self_attn.q_proj.weight").numpy(), expected
        )


def test_memory_is_bounded_by_the_chunk_not_the_tensor(tmp_path):
    """A 32 MB fp32 tensor converted 1 MB at a time never holds more than a few MB (numpy reports
    its buffers to tracemalloc)."""
    rng = np.random.default_rng(1)
    path = tmp_path / "big.gguf"
    write_gguf(
        path,
        {
            "token_embd.weight": (
                rng.standard_normal((2048, 4096), dtype=np.float32),
                gguf.GGMLQuantizationType.Q8_0,
            )
        },
    )
    reader = gguf.GGUFReader(str(path))
    plans = plans_for(reader, {"token_embd.weight": "model.embed_tokens.weight"})
    tracemalloc.start()
    try:
        gguf_stream.write_safetensors(
            path, reader, plans, tmp_path / "big.safetensors", chunk_bytes=2**20
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert plans[0].nbytes == 32 * 2**20
    assert peak < 8 * 2**20, peak


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        gguf_stream.plan_tensors(None, None, "gpt2")


@pytest.mark.slow
def test_smollm2_matches_transformers_dequantization(smollm2_dir):
    """The session's SmolLM2 folder (tests/conftest.py) is this module's conversion of the package's GGUF
    (`python -m ssd_engine.models.gguf_stream`, run once per machine): every tensor equals transformers'."""
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from ssd_engine.models.default_models import find_smollm2_gguf

    source = find_smollm2_gguf()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(smollm2_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)[
        "tensors"
    ]
    with safe_open(str(Path(smollm2_dir) / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)  # tied: no lm_head in either
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), expected[name].float()), name
