"""target_dtype="gguf": the target's Linears kept in their GGUF checkpoint's own quantized blocks.

- The kernels (kernels/gguf_matmul.cpp) against gguf's own dequantizer, for every block type they
  read: the dequantized values bit for bit, a product within fp32 rounding of the float64 one on
  odd shapes, and each row's bits independent of the row count (1 .. 64 rows, past a pass of rows).
- A small GGUF file (tests/gguf_checkpoints.py: Q4_K, Q6_K, Q8_0, Q5_0 and Q4_1 blocks, the mix
  a Q4_K_M file holds): greedy AR equals transformers on the dequantized checkpoint token for
  token; SD and SSD equal that AR output; each Linear holds only its blocks.
- Without the kernels the target runs its fp32 weights and says so; a folder with no known GGUF,
  and a tensor-parallel slice that splits a block, are one-line errors.
- gguf-int8 (int8-rounded activations, another model): the kernel against float64 products of
  the rounded activations; a row's logits equal from a prefill, one-token steps and K + 1-token
  steps; greedy SD and SSD equal its own AR, which differs from gguf's.
- auto (the default) keeps a GGUF target's blocks and leaves a plain folder in fp32.
"""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package")
from gguf.quants import dequantize  # noqa: E402
from gguf_checkpoints import gguf_checkpoint, random_blocks  # noqa: E402
from ssd_engine.kernels import gguf_cpu  # noqa: E402
from test_greedy_generation import _oracle, _prompts  # noqa: E402

from ssd_engine import LLM, SamplingParams, testing  # noqa: E402
from ssd_engine.distributed.partition import Span  # noqa: E402
from ssd_engine.layers.gguf_weight import GGUFWeight, QuantizedRows  # noqa: E402

pytestmark = pytest.mark.skipif(
    not gguf_cpu.available(), reason="no C++ compiler to build the GGUF kernels"
)
KINDS = sorted(gguf_cpu.BLOCKS)
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def blocks_of(kind: int, rows: int, blocks_per_row: int, seed: int = 0):
    cols = blocks_per_row * gguf_cpu.BLOCKS[kind].values
    stored = random_blocks(rows, cols, kind, np.random.default_rng(seed))
    return (
        torch.from_numpy(stored),
        dequantize(stored, gguf.GGMLQuantizationType(kind)).reshape(rows, cols),
        cols,
    )


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: gguf.GGMLQuantizationType(k).name)
def test_blocks_dequantize_to_ggufs_own_values_and_multiply_within_rounding(kind):
    blocks, reference, cols = blocks_of(kind, 37, 3)
    ops = torch.ops.ssd_engine_gguf
    assert np.array_equal(
        ops.dequantize(blocks, kind, cols).numpy().view(np.uint32), reference.view(np.uint32)
    )
    x = torch.randn(11, cols)
    exact = x.double() @ torch.from_numpy(reference).double().T
    got = ops.linear(x, blocks, kind, cols)
    bound = 8 * cols * 2**-24 * (x.double().abs() @ torch.from_numpy(reference).double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("kind", [12, 14, 8], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_each_rows_bits_do_not_depend_on_the_row_count(kind):
    blocks, _, cols = blocks_of(kind, 21, 2)
    x = torch.randn(64, cols)
    whole = torch.ops.ssd_engine_gguf.linear(x, blocks, kind, cols)
    for rows in (1, 2, 3, 5, 8, 9, 17, 40):
        for start in (0, 64 - rows):
            assert torch.equal(
                torch.ops.ssd_engine_gguf.linear(x[start : start + rows], blocks, kind, cols),
                whole[start : start + rows],
            ), (rows, start)


def test_a_fused_linear_of_mixed_types_at_decode_and_prefill_row_counts():
    q4k, ref_a, cols = blocks_of(12, 24, 2, seed=1)
    q6k, ref_b, _ = blocks_of(14, 8, 2, seed=2)
    more, ref_c, _ = blocks_of(12, 16, 2, seed=3)
    weight = GGUFWeight(
        [QuantizedRows(q4k, 12, cols), QuantizedRows(q6k, 14, cols), QuantizedRows(more, 12, cols)]
    )
    assert [p.kind for p in weight.parts] == [12, 14, 12]
    # 16 outputs a panel, 2368 / 3360 bytes a super-block
    if gguf_cpu.panels_available(int8_activations=False):
        assert weight.nbytes == (2 * 2368 + 1 * 3360 + 1 * 2368) * 2
    else:
        assert weight.nbytes == q4k.numel() + q6k.numel() + more.numel()
    reference = torch.from_numpy(np.concatenate([ref_a, ref_b, ref_c]))
    assert torch.equal(weight.dequantized(), reference)
    bias = torch.randn(48)
    for rows in (1, 5, 100):
        x = torch.randn(rows, cols)
        torch.testing.assert_close(weight(x, bias), x @ reference.T + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [12, 14, 8, 6], ids=["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("int8_activations", [False, True], ids=["gguf", "gguf-int8"])
def test_a_gguf_target_linear_gives_a_row_the_same_bits_at_every_engine_row_count(
    kind, int8_activations
):
    """What the engine multiplies (GGUFWeight: panels where this CPU has them, else the block kernels) at
    the row counts it runs: decode, K + 1 verification rows, batches of them, prefill chunks up to
    max_num_batched_tokens. Regression: past 64 rows the gguf target took a dense matmul on dequantized
    tiles, whose bits differ from the block kernel's (on AVX2-only CPUs every kind ran it)."""
    blocks, _, cols = blocks_of(kind, 24, 2 if gguf_cpu.BLOCKS[kind].values == 256 else 16)
    weight = GGUFWeight([QuantizedRows(blocks, kind, cols)], int8_activations=int8_activations)
    x = torch.randn(2048, cols, generator=torch.Generator().manual_seed(kind))
    checked = (0, 3, 17, 63, 64, 65, 511, 2047)
    alone = {i: weight(x[i : i + 1], None) for i in checked}
    for rows in (2, 5, 40, 64, 65, 100, 512, 2048):
        out = weight(x[:rows], None)
        for i in (i for i in checked if i < rows):
            assert torch.equal(out[i : i + 1], alone[i]), (rows, i)


def rounded_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as gguf_int8.cpp multiplies it: int8 codes of amax / 127 steps per `block` values (the
    product with 127 / amax in fp32, rounded to nearest even), in float64."""
    grouped = x.float().reshape(x.shape[0], -1, block)
    amax = grouped.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(grouped * inverse).double() * (amax / 127).double()).reshape(x.shape)


@pytest.mark.parametrize(
    "kind", gguf_cpu.INT8_KINDS, ids=lambda k: gguf.GGMLQuantizationType(k).name
)
def test_int8_activations_multiply_the_rounded_rows_and_each_row_alone(kind):
    blocks, reference, cols = blocks_of(kind, 29, 3 if gguf_cpu.BLOCKS[kind].values == 256 else 9)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(kind))
    got = torch.ops.ssd_engine_gguf.linear_int8(x, blocks, kind, cols)
    expected = (
        rounded_activations(x, 256 if gguf_cpu.BLOCKS[kind].values == 256 else 32)
        @ torch.from_numpy(reference).double().T
    )
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert (
        got.double() - x.double() @ torch.from_numpy(reference).double().T
    ).abs().max() > 1e-3  # really rounded
    for rows in (1, 2, 3, 5, 8, 9, 17):
        for start in (0, 40 - rows):
            assert torch.equal(
                torch.ops.ssd_engine_gguf.linear_int8(x[start : start + rows], blocks, kind, cols),
                got[start : start + rows],
            ), (rows, start)


# --------------------------------------------------------------------------- a GGUF model


def q4_k_m(hf_name: str) -> int:
    """Q4_K_M's mix: Q6_K for half the v / down projections and the head, plus the 32-value types."""
    if (
        "layers.0." in hf_name
        and ("v_proj" in hf_name or "down_proj" in hf_name)
        or "lm_head" in hf_name
    ):
        return 14
    if "layers.1.self_attn.o_proj" in hf_name:
        return 8
    if "embed_tokens" in hf_name:
        return 6  # Q5_0: a tied head multiplies by these
    if "layers.1.mlp.up_proj" in hf_name:
        return 3
    return 12


SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def gguf_model(tiny_model_dir, tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = gguf_checkpoint(
                tiny_model_dir(arch, **SIZES),
                str(tmp_path_factory.mktemp(f"gguf_{arch}")),
                arch,
                q4_k_m,
            )
        return made[arch]

    return get


DESCRIBED = {
    "gguf": "gguf (the checkpoint's blocks)",
    "gguf-int8": "gguf-int8 (the checkpoint's blocks, int8 activations)",
}


def _generate(folder: str, fmt: str = "gguf", **options) -> list[list[int]]:
    with LLM(folder, num_threads=1, target_dtype=fmt, **options) as llm:
        assert llm.engine.execution()["target_dtype"] == DESCRIBED[fmt]
        return [o.token_ids for o in llm.generate(_prompts(3), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "arch", ["qwen2", "llama"]
)  # llama: q / k rows stored permuted in the file
def test_greedy_equals_transformers_on_the_dequantized_checkpoint(gguf_model, arch):
    folder, _ = gguf_model(arch)
    expected = [out[:NEW_TOKENS] for out in _oracle(folder, _prompts(3))]
    assert _generate(folder, speculative_mode="ar") == expected


@pytest.mark.parametrize("fmt", ["gguf", "gguf-int8"])
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sd_and_ssd_equal_ar_with_the_target_in_its_blocks(gguf_model, tiny_model_dir, mode, fmt):
    folder, _ = gguf_model("qwen2")
    options = dict(
        speculative_mode=mode,
        draft_model=tiny_model_dir("qwen2", seed=1, **SIZES),
        num_speculative_tokens=3,
    )
    if mode == "ssd":
        options.update(ssd_budget=4)
    ar = _generate(folder, fmt, speculative_mode="ar")
    assert _generate(folder, fmt, **options) == ar
    # another model: its greedy path parts from the checkpoint's
    if fmt == "gguf-int8" and mode == "sd":
        assert ar != _generate(folder, "gguf", speculative_mode="ar")


def test_an_int8_activation_targets_logits_do_not_depend_on_the_other_rows(gguf_model):
    from dataclasses import replace

    from test_target_dtype import BLOCK_SIZE, PROMPTS, _logits

    from ssd_engine.core.config import EngineConfig
    from ssd_engine.runtime.model_runner import RunnerSpec

    folder, _ = gguf_model("qwen2")
    tokens, prompt_len = PROMPTS[3] + PROMPTS[2][:9], len(PROMPTS[3])
    blocks = -(-len(tokens) // BLOCK_SIZE)
    config = EngineConfig.from_kwargs(
        model=folder,
        target_dtype="gguf-int8",
        speculative_mode="ar",
        block_size=BLOCK_SIZE,
        num_threads=1,
    )
    runner = RunnerSpec(
        config.model, replace(config.cache, num_kv_blocks=blocks), len(tokens) + 2
    ).build()
    table = list(range(blocks))
    prefill = _logits(runner, tokens, prompt_len, len(tokens), table)
    for step in (1, 2, 4):  # decode, and verification-shaped steps
        assert torch.equal(_logits(runner, tokens, prompt_len, step, table), prefill), step


def test_each_linear_holds_only_its_blocks(gguf_model):
    folder, _ = gguf_model("qwen2")
    with LLM(folder, num_threads=1, target_dtype="gguf", speculative_mode="ar") as llm:
        model = llm.engine.runner.local.model
        linears = [m for m in model.modules() if type(m).__name__ == "Linear"]
        assert linears and all(
            m.weight is None and isinstance(m.prepared, GGUFWeight) for m in linears
        )
        kinds = {p.kind for m in linears for p in m.prepared.parts}
        assert kinds == {12, 14, 8, 3}  # the head's Q6_K, o_proj's Q8_0, up_proj's Q4_1 beside Q4_K


def test_without_the_kernels_the_target_runs_its_fp32_weights(gguf_model, monkeypatch, capsys):
    folder, _ = gguf_model("qwen2")
    expected = _generate(folder, speculative_mode="ar")
    monkeypatch.setenv(testing.NO_GGUF_KERNEL, "1")
    gguf_cpu.load.cache_clear()
    try:
        with LLM(folder, num_threads=1, target_dtype="gguf", speculative_mode="ar") as llm:
            outputs = [o.token_ids for o in llm.generate(_prompts(3), GREEDY, use_tqdm=False)]
    finally:
        gguf_cpu.load.cache_clear()
    assert "target_dtype=gguf: the GGUF kernels are switched off" in capsys.readouterr().out
    assert outputs == expected


def test_a_folder_without_a_gguf_and_a_split_block_are_one_line_errors(tiny_model_dir, gguf_model):
    with pytest.raises(ValueError, match="target_dtype=gguf needs the GGUF file") as error:
        LLM(tiny_model_dir("qwen2"), num_threads=1, target_dtype="gguf", speculative_mode="ar")
    assert "\n" not in str(error.value)
    from transformers import AutoConfig

    from ssd_engine.models.gguf_weights import GGUFFile

    folder, path = gguf_model("qwen2")
    source = GGUFFile(__import__("pathlib").Path(path), AutoConfig.from_pretrained(folder))
    with pytest.raises(ValueError, match="do not fall on its 256-value blocks"):
        source.rows("model.layers.0.mlp.down_proj.weight", Span(0, 256), Span(128, 256))
    part = source.rows("model.layers.0.mlp.down_proj.weight", Span(0, 256), Span(256, 256))
    assert part.cols == 256 and part.blocks.shape == (256, 210)


# --------------------------------------------------------------------------- the default: auto


def test_auto_keeps_a_gguf_targets_blocks_and_a_plain_folders_fp32(
    gguf_model, tiny_model_dir, tmp_path
):
    from ssd_engine.core.config import EngineConfig
    from ssd_engine.models import default_models
    from ssd_engine.planning.plan import resolve_target_format

    folder, _ = gguf_model("qwen2")
    plain = tiny_model_dir("qwen2")
    # a folder standing in under the built-in target's name, whose marker does not name its GGUF
    stand_in = tmp_path / default_models.DEFAULT_TARGET.name
    __import__("shutil").copytree(plain, stand_in)
    (stand_in / default_models.MARKER).write_text("{}\n")
    chosen = {
        path: resolve_target_format(
            EngineConfig.from_kwargs(model=str(path), speculative_mode="ar")
        ).model.target_dtype
        for path in (folder, plain, stand_in)
    }
    assert chosen == {folder: "gguf-int8", plain: "fp32", stand_in: "fp32"}
    assert (
        resolve_target_format(
            EngineConfig.from_kwargs(model=folder, speculative_mode="ar", target_dtype="fp32")
        ).model.target_dtype
        == "fp32"
    )
    # target_dtype left to its default
    with LLM(folder, num_threads=1, speculative_mode="ar") as llm:
        assert llm.engine.execution()["target_dtype"] == DESCRIBED["gguf-int8"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_tensor_table_reads_what_ggufs_reader_reads(gguf_model, arch):
    from gguf import GGUFReader

    from ssd_engine.models.gguf_table import GGUFTable

    _, path = gguf_model(arch)
    table, reader = GGUFTable(path), GGUFReader(path)
    assert (
        table.field("general.architecture")
        == reader.fields["general.architecture"].contents()
        == arch
    )
    assert [t.name for t in table.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(table.tensors, reader.tensors):
        assert (ours.tensor_type, list(ours.shape), ours.data_offset) == (
            theirs.tensor_type,
            list(theirs.shape),
            theirs.data_offset,
        ), ours.name
        assert np.array_equal(np.asarray(ours.data), np.asarray(theirs.data)), ours.name
