"""Q4_K and Q6_K blocks repacked 16 outputs to a panel (kernels/gguf_panels.h), and the kernels
reading them: fp32 rows (gguf_panels_fp32.cpp, target_dtype "gguf", AVX-512) and int8-rounded rows
(gguf_vnni.cpp, "gguf-int8", AVX-512 VNNI).

- fp32: the panels hold gguf's own dequantized values exactly, and a product is within fp32
  rounding of the float64 one;
- int8: against float64 products of the rounded activations, as gguf_int8.cpp's blocks are; where
  the CPU has AMX, 16 rows at a time run in tiles (`int8_panel_tiles()` says whether they do here)
  and every row still gets the bits it gets alone;
- both on output counts that leave a partial last panel and on the blocks' extreme codes and
  scales, and each row's bits independent of the rows beside it across passes of rows (6 a pass);
- a GGUFWeight on such a CPU holds the panels and no GGUF copy;
- every product (blocks and panels) compiles under torch.compile, to the eager call's bits.
"""

import pytest
import torch
from ssd_engine.kernels import gguf_cpu
from test_gguf_target import blocks_of, rounded_activations

from ssd_engine.layers.gguf_weight import GGUFWeight, PanelRows, QuantizedRows

KINDS = {"Q4_K": 12, "Q6_K": 14}
FP32 = pytest.mark.skipif(
    not gguf_cpu.panels_available(int8_activations=False),
    reason="the fp32 panel kernels need AVX-512 and a C++ compiler",
)
INT8 = pytest.mark.skipif(
    not gguf_cpu.panels_available(int8_activations=True),
    reason="the int8 panel kernels need AVX-512 VNNI and a C++ compiler",
)


def same_bits_at_every_row_count(linear, x: torch.Tensor, whole: torch.Tensor) -> None:
    # passes of 6 rows; AMX tiles of 16 (from 32 / 48 rows)
    for rows in (
        1,
        2,
        5,
        6,
        7,
        13,
        16,
        17,
        33,
        48,
        50,
    ):
        for start in (0, x.shape[0] - rows):
            assert torch.equal(linear(x[start : start + rows]), whole[start : start + rows]), (
                rows,
                start,
            )


@FP32
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("outputs", [16, 37])
def test_fp32_panels_hold_ggufs_values_and_multiply_within_rounding(kind, outputs):
    blocks, reference, cols = blocks_of(kind, outputs, 3, seed=outputs)
    weight = GGUFWeight([QuantizedRows(blocks, kind, cols)])
    assert isinstance(weight.parts[0], PanelRows)
    assert torch.equal(weight.dequantized(), torch.from_numpy(reference))
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(kind))
    got = weight(x, None)
    w = torch.from_numpy(reference).double()
    bound = 8 * cols * 2**-24 * (x.double().abs() @ w.abs().T)
    assert ((got.double() - x.double() @ w.T).abs() <= bound).all()
    same_bits_at_every_row_count(lambda rows: weight(rows, None), x, got)


@FP32
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_fp32_panels_of_extreme_codes_and_scales(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = extreme_blocks(kind, 18, 2)
    reference = torch.from_numpy(
        dequantize(blocks.numpy(), GGMLQuantizationType(kind)).reshape(18, 512)
    )
    weight = GGUFWeight([QuantizedRows(blocks, kind, 512)])
    assert torch.equal(weight.dequantized(), reference)


def extreme_blocks(kind: int, rows: int, blocks_per_row: int) -> torch.Tensor:
    """Every code at its maximum and the scales at their extremes (Q6_K's signed -128), so an
    overflow or a sign lost in the packing shows."""
    blocks, _, _ = blocks_of(kind, rows, blocks_per_row)
    blocks = blocks.reshape(rows, blocks_per_row, -1).clone()
    if kind == 12:
        blocks[..., 4:144] = 0xFF  # 6-bit scales and minimums 63, codes 15
    else:
        blocks[..., :192] = 0xFF  # codes 63
        blocks[..., 192:208] = torch.tensor([-128, 127] * 8, dtype=torch.int8).view(torch.uint8)
    return blocks.reshape(rows, -1).contiguous()


@INT8
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("outputs", [16, 37])
def test_int8_panels_multiply_the_rounded_rows_and_each_row_alone(kind, outputs):
    blocks, reference, cols = blocks_of(kind, outputs, 3, seed=outputs)
    ops = torch.ops.ssd_engine_gguf
    panels = ops.pack_panels(blocks, kind, cols)
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(kind))
    got = ops.linear_int8_panels(x, panels, kind, cols, outputs)
    expected = rounded_activations(x, 256) @ torch.from_numpy(reference).double().T
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    same_bits_at_every_row_count(
        lambda rows: ops.linear_int8_panels(rows, panels, kind, cols, outputs), x, got
    )


@INT8
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_int8_panels_of_extreme_codes_and_scales(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = extreme_blocks(kind, 18, 2)
    reference = torch.from_numpy(
        dequantize(blocks.numpy(), GGMLQuantizationType(kind)).reshape(18, 512)
    ).double()
    x = (
        torch.randn(51, 512, generator=torch.Generator().manual_seed(1)) * 50
    )  # 3 tiles of 16 rows, 3 in passes
    x[0] = x[0].abs()  # every code of a 256-value block at +127 in one row
    x[17] = -x[0]
    got = torch.ops.ssd_engine_gguf.linear_int8_panels(
        x, torch.ops.ssd_engine_gguf.pack_panels(blocks, kind, 512), kind, 512, 18
    )
    torch.testing.assert_close(
        got.double(), rounded_activations(x, 256) @ reference.T, rtol=1e-5, atol=1e-3
    )


@INT8
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_int8_panels_give_each_row_its_bits_across_chunks_and_panel_groups(kind):
    """A prefill's rows: on AMX the tiles walk rows in chunks (~1 MB of codes: 96 rows at 10240 columns)
    and panels in groups; each row must still get its bits alone."""
    blocks, _, cols = blocks_of(kind, 72, 40, seed=3)
    ops = torch.ops.ssd_engine_gguf
    panels = ops.pack_panels(blocks, kind, cols)
    x = torch.randn(200, cols, generator=torch.Generator().manual_seed(2))
    whole = ops.linear_int8_panels(x, panels, kind, cols, 72)
    for start, rows in ((0, 1), (95, 2), (96, 7), (190, 3), (199, 1)):
        assert torch.equal(
            ops.linear_int8_panels(x[start : start + rows], panels, kind, cols, 72),
            whole[start : start + rows],
        ), (start, rows)


@INT8
def test_int8_panels_run_tiles_only_where_the_cpu_has_amx():
    from ssd_engine.utils.machine import cpu_flags

    tiles = torch.ops.ssd_engine_gguf.int8_panel_tiles()
    assert not tiles or "amx_int8" in cpu_flags()


@INT8
def test_a_gguf_int8_weight_holds_panels_only():
    q4k, _, cols = blocks_of(12, 24, 2, seed=1)
    q8, _, _ = blocks_of(8, 8, 16, seed=2)  # Q8_0: no panels, gguf_int8.cpp's blocks as they are
    weight = GGUFWeight(
        [QuantizedRows(q4k, 12, cols), QuantizedRows(q8, 8, cols)], int8_activations=True
    )
    assert [type(p) for p in weight.parts] == [PanelRows, QuantizedRows]
    assert weight.nbytes == weight.parts[0].panels.numel() + q8.numel()
    x = torch.randn(4, cols)
    expected = torch.cat(
        [
            torch.ops.ssd_engine_gguf.linear_int8_panels(x, weight.parts[0].panels, 12, cols, 24),
            torch.ops.ssd_engine_gguf.linear_int8(x, q8, 8, cols),
        ],
        dim=1,
    )
    assert torch.equal(weight(x, None), expected)


@pytest.mark.parametrize("op", ["linear", "linear_int8", "linear_panels", "linear_int8_panels"])
def test_each_product_declares_its_output_so_a_step_compiles(op):
    """compile_model traces a step with data-less tensors: each product says what it returns
    (kernels/gguf_cpu.py), and a compiled call gives the eager call's bits."""
    if not gguf_cpu.available():
        pytest.skip("no C++ compiler to build the GGUF kernels")
    if op.endswith("panels") and not gguf_cpu.panels_available(
        int8_activations=op == "linear_int8_panels"
    ):
        pytest.skip("this CPU runs no panels")
    blocks, _, cols = blocks_of(12, 37, 2, seed=3)
    ops = torch.ops.ssd_engine_gguf
    weight = ops.pack_panels(blocks, 12, cols) if op.endswith("panels") else blocks
    args = (torch.randn(3, cols), weight, 12, cols) + ((37,) if op.endswith("panels") else ())
    torch.library.opcheck(getattr(ops, op), args, test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: getattr(ops, op)(*a) + 1, fullgraph=True)
    assert torch.equal(compiled(*args), getattr(ops, op)(*args) + 1)
