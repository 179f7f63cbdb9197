"""A decoder layer's elementwise work as the C++ ops of kernels/cpu_layer_ops.py (fused_kernels auto on
a CPU): each op against the torch ops it replaces, on odd shapes (head dims that are not powers of
two, strided rows, scattered cache slots, Qwen3's q/k norms, bf16); then whole engines: the layers
call them, greedy output stays transformers', and a decode layer dispatches a handful of ops."""

import hf_oracle
import pytest
import torch
import torch.nn.functional as F
from instrumentation.op_count import OpCounter, without_row_padding
from ssd_engine.kernels import cpu_layer_ops, gguf_cpu

from ssd_engine import LLM, SamplingParams
from ssd_engine.layers.rotary import rotate

pytestmark = pytest.mark.skipif(
    not gguf_cpu.available(), reason="the CPU kernels do not build here"
)

TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 896), (5, 40), (37, 1500)])
def test_add_rms_norm_matches_the_torch_ops(rows, n, dtype):
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n + 3, generator=g)[:, :n].to(dtype)  # strided rows
    residual = torch.randn(rows, n, generator=g).to(dtype)
    weight = torch.randn(
        n, generator=g
    )  # fp32 beside bf16 activations, as a bf16 draft's norms are
    out, total = cpu_layer_ops.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(total, x + residual, atol=0, rtol=0)
    expected = F.rms_norm((x + residual).float(), (n,), weight, 1e-6).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 16), (6, 2, 40), (14, 2, 64)])
def test_rope_cache_write_rotates_q_and_writes_k_and_v_at_their_slots(hq, hk, d, qk_norm, dtype):
    g = torch.Generator().manual_seed(hq * d + qk_norm)
    tokens, slots_total = 7, 32
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g)
    angles = torch.randn(tokens, d // 2, generator=g)
    tables = torch.stack(
        [torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)], 1
    )
    rope = (
        tables[:, :1].to(dtype),
        tables[:, 1:].to(dtype),
    )  # strided views, as RotaryEmbedding.tables gives
    slots = torch.randperm(slots_total, generator=g)[:tokens]
    k_cache = torch.zeros(slots_total, hk, d, dtype=dtype)
    v_cache = torch.zeros(slots_total, hk, d, dtype=dtype)
    norms = (torch.randn(d, generator=g), torch.randn(d, generator=g)) if qk_norm else (None, None)
    q = cpu_layer_ops.rope_cache_write(
        qkv.to(dtype), *rope, slots, k_cache, v_cache, hq, hk, *norms, 1e-6
    )

    q_ref, k_ref, v_ref = (
        part.view(tokens, -1, d) for part in qkv.split([hq * d, hk * d, hk * d], -1)
    )
    if qk_norm:  # in fp32, rounded where the torch layer rounds its normed heads
        q_ref = F.rms_norm(q_ref, (d,), norms[0], 1e-6).to(dtype).float()
        k_ref = F.rms_norm(k_ref, (d,), norms[1], 1e-6).to(dtype).float()
    fp32_rope = (tables[:, :1].to(dtype).float(), tables[:, 1:].to(dtype).float())
    torch.testing.assert_close(q.float(), rotate(q_ref, fp32_rope), **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache[slots].float(), rotate(k_ref, fp32_rope), **TOLERANCE[dtype])
    torch.testing.assert_close(v_cache[slots], v_ref.to(dtype), atol=0, rtol=0)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_fp32_rope_is_the_torch_layers_bits():
    """fp32 RoPE rounds each product before the sum, as torch's x * cos + roll(x) * sin does (no
    fused multiply-add): the rotated q and k are the eager layer's bits, not merely close."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 8 * 64, generator=g) * 30
    angles = torch.randn(5, 32, generator=g) * 100
    tables = torch.stack(
        [torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)], 1
    )
    rope = (tables[:, :1], tables[:, 1:])
    k_cache, v_cache = torch.zeros(8, 2, 64), torch.zeros(8, 2, 64)
    q = cpu_layer_ops.rope_cache_write(qkv, *rope, torch.arange(5), k_cache, v_cache, 4, 2)
    assert torch.equal(q, rotate(qkv[:, :256].view(5, 4, 64), rope))
    assert torch.equal(k_cache[:5], rotate(qkv[:, 256:384].view(5, 2, 64), rope))


def test_bad_shapes_get_a_one_line_error():
    with pytest.raises(RuntimeError, match="residual must match x"):
        cpu_layer_ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"qkv must be \[T, \(Hq \+ 2 Hk\) \* D\]"):
        cpu_layer_ops.rope_cache_write(
            torch.randn(2, 100),
            torch.randn(2, 1, 16),
            torch.randn(2, 1, 16),
            torch.arange(2),
            torch.zeros(4, 1, 16),
            torch.zeros(4, 1, 16),
            2,
            1,
        )


PROMPTS = [list(range(5, 16)), [7, 8, 9]]


@pytest.mark.parametrize("arch,mode", [("qwen3", "ar"), ("llama", "sd"), ("qwen2", "sd")])
def test_engine_runs_the_cpu_ops_by_default_and_matches_transformers(tiny_model_dir, arch, mode):
    path = tiny_model_dir(arch, vocab_size=259)
    expected = hf_oracle.greedy(path, PROMPTS, 10)
    options = dict(dtype="float32", block_size=4, max_num_batched_tokens=16)
    if mode == "sd":
        options.update(
            draft_model=tiny_model_dir(arch, seed=1, vocab_size=259),
            speculative_mode="sd",
            num_speculative_tokens=3,
            draft_dtype="fp32",
        )
    with LLM(path, **options) as llm:
        assert llm.engine.runner.local.layer_ops is cpu_layer_ops
        assert llm.engine.execution()["fused_kernels"] == "on"
        outputs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
        )
    assert [o.token_ids for o in outputs] == expected


def test_a_cpu_decode_layer_dispatches_few_ops(tiny_model_dir):
    """The point of the ops: a one-token layer dispatches its four matmuls, attention, two norms, RoPE
    and SiLU-mul's two: 10, where torch's ops take 17 (each RMSNorm itself six on a CPU). Layers after
    the first are counted: the first also expands the step's attention metadata, once for all."""
    path = tiny_model_dir("qwen2", vocab_size=259, num_hidden_layers=3)
    counts = {}
    for fused in ("off", "auto"):
        # without this machine's row padding, which adds ops to a padded step (layers/row_padding.py)
        with (
            without_row_padding(),
            LLM(path, dtype="float32", block_size=4, fused_kernels=fused) as llm,
        ):
            llm.engine.add_request(
                [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            )
            llm.engine.step()  # the prefill
            layers = list(llm.engine.runner.local.model.model.layers)[1:]
            with OpCounter() as ops, ops.scoped(layers, "layer"):
                llm.engine.step()  # one decode step
        counts[fused] = ops.total("layer", "compute") / ops.calls["layer"]
    assert counts["auto"] <= 10 and counts["auto"] <= counts["off"] - 7, counts
