"""target_dtype: a re-quantized target (bf16 / int8 / int4 Linears), and SD / SSD exact against IT.

A target in bf16, int8 or int4 is a different model from the fp32 checkpoint; the contract is that
AR, SD and SSD emit that model's own output: greedy token for token, and at T > 0 its own law.
Verification compares against the quantized target's probabilities, so what this needs from the
engine is that a row's logits never depend on the other rows computed with it: AR scores a lone
decode row, SD and SSD score K + 1 verification rows, a batch mixes sequences.

- Row independence of the formats' kernels (layers/weight_formats.py), at the 1.5B target's widths
  where oneDNN's packed kernels give a lone row other bits than two or more (a lone row is then
  run padded to two), and of the whole target: the same positions' logits from a prefill, from
  one-token decode steps, from K + 1-token steps and from a batch with another sequence, bitwise
  equal. The model-level checkpoint is wide enough (1536) for oneDNN's one-row kernel to differ;
  its attention is layers/attention.py `row_independent_attention` (CPU SDPA's bits depend on the
  query block's size and the masked key count: without it the decode rows differ by up to 0.06).
- Greedy: SD and SSD equal the quantized target's own AR output, per format; and the format
  really changes the model (its logits differ from fp32's).
- T > 0: SD with an int4 target follows the int4 target's own exact law (enumerated from its AR
  logits: the 16-token pair of tests/small_pair.py), goodness of fit as in test_distribution.py;
  the test has the power to tell that law from the fp32 checkpoint's.
- A bad value, and an int format on CUDA, are one-line errors naming the option.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from cpu_features import format_params
from exact_law import output_law
from small_pair import DIST_PROMPT, engine_options
from stats_helpers import fit, gof_power
from tiny_checkpoints import derived_checkpoint

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.config import EngineConfig
from ssd_engine.core.option_choices import REQUANTIZED
from ssd_engine.layers.attention import row_independent_attention
from ssd_engine.layers.attention_backends import backend_name
from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE, ROW_TILE, prepare
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.runtime.step_inputs import StepInputs

QUANTIZED = list(REQUANTIZED)
K = 3
BLOCK_SIZE = 8
NEW_TOKENS = 32
PROMPTS = [
    [(31 * i + 7 * j) % 250 + 3 for j in range(3 + 5 * i)] for i in range(4)
]  # ragged, 3..18 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
COMMON = dict(num_threads=1, block_size=BLOCK_SIZE)
# wide enough for oneDNN's one-row kernel to give other bits than its many-row one (measured on an
# AMD EPYC at 1536 input columns, not at 1024): the padding of a lone row is exercised end to end
WIDE = dict(
    hidden_size=1536,
    intermediate_size=1536,
    num_hidden_layers=1,
    num_attention_heads=12,
    num_key_value_heads=2,
)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "options,named",
    [
        (dict(target_dtype="int3"), "target_dtype must be one of"),
        (dict(target_dtype="q4_k"), "target_dtype must be one of"),
        (dict(target_dtype="int8", device="cuda"), "target_dtype=int8 is CPU-only"),
        (dict(target_dtype="int4", device="cuda:1"), "target_dtype=int4 is CPU-only"),
    ],
)
def test_bad_values_are_one_line_errors(options, named):
    with pytest.raises(ValueError) as error:
        EngineConfig.from_kwargs(**options)
    assert str(error.value).startswith(named) and "\n" not in str(error.value)


def test_the_option_reaches_the_target_and_not_the_draft():
    assert (
        EngineConfig().model.target_dtype == "auto" and EngineConfig().model.weight_format is None
    )
    for fmt in QUANTIZED:
        model = EngineConfig.from_kwargs(target_dtype=fmt).model
        assert (model.weight_format, model.row_independent) == (fmt, True)
    assert (
        EngineConfig.from_kwargs(target_dtype="bf16", device="cuda").model.weight_format == "bf16"
    )
    from ssd_engine.cli_args import ArgumentParser, add_engine_args, engine_options

    parser = ArgumentParser()
    add_engine_args(parser)
    assert engine_options(parser.parse_args(["--target-dtype", "int4"]))["target_dtype"] == "int4"
    with pytest.raises(SystemExit):  # argparse refuses a value outside the choices
        parser.parse_args(["--target-dtype", "q4_k"])


def test_bench_parses_the_option_and_hands_it_to_every_engine_of_ours():
    from suite import options, ours  # benchmarks/ (on the path: tests/conftest.py)
    from suite.report import _draft_setting

    opts = options.parse(
        ["--model", "t", "--draft", "d", "--mode", "ar,sd", "--target-dtype", "int4"]
    )
    assert (
        opts.target_dtype == "int4" and ours._engine_options(opts, True)["target_dtype"] == "int4"
    )
    assert options.parse(["--model", "t", "--mode", "ar"]).target_dtype == "auto"
    with pytest.raises(SystemExit):
        options.parse(
            ["--model", "t", "--mode", "ar", "--device", "cuda", "--target-dtype", "int8"]
        )
    assert "target weights int4" in _draft_setting({"draft_dtype": "auto", "target_dtype": "int4"})
    assert "target" not in _draft_setting(
        {"draft_dtype": "auto"}
    )  # older result files: the fp32 target


# --------------------------------------------------------------------------- row independence


# the row counts the engine runs: a decode row, K + 1 verification rows, batches of them (8 x 5 = 40),
# a full ROW_TILE and one past it, and prefill chunks up to max_num_batched_tokens (512 on CPU, 2048 on a GPU)
ENGINE_ROW_COUNTS = (1, 2, 3, 5, K + 1, ROW_TILE, ROW_TILE + 1, 40, 64, 512, 2048)


@pytest.mark.parametrize("fmt", format_params(["fp32", *REQUANTIZED]))
@pytest.mark.parametrize("shape", [(4096, 1536), (256, 1536)])
def test_a_target_format_gives_each_row_the_same_bits_at_any_row_count(fmt, shape):
    """Regression (an Intel Xeon with AMX): oneDNN's bf16 matmul gave row 0 other bits at 40 rows than
    alone, as it switched to AMX tiles; every count here must give the lone row's bits on the CPU the
    suite runs on (the wide shape stops at 512 rows: past ROW_TILE a call's rows are cut the same way)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=g) * 0.05
    counts = [rows for rows in ENGINE_ROW_COUNTS if rows <= (512 if shape[0] > 256 else 2048)]
    x = torch.randn(max(counts), shape[1], generator=g).to(ACTIVATION_DTYPE[fmt])
    prepared = prepare(weight, fmt, row_independent=True)
    sampled = torch.randint(0, x.shape[0], (6,), generator=g).tolist()
    checked = sorted(
        {i for i in (0, 1, 4, 15, 16, 17, 39, 63, 511, 2047, *sampled) if i < x.shape[0]}
    )
    alone = {i: prepared(x[i : i + 1], None) for i in checked}
    for rows in counts:
        out = prepared(x[:rows], None)
        for i in (i for i in checked if i < rows):
            assert torch.equal(out[i : i + 1], alone[i]), (rows, i)
    shuffled = torch.randperm(
        64, generator=g
    )  # a row's position in the batch does not matter either
    out = prepared(x[shuffled], None)
    for position, i in enumerate(shuffled.tolist()):
        if i in alone:
            assert torch.equal(out[position : position + 1], alone[i]), ("shuffled", i)


@pytest.mark.parametrize("fmt", format_params(["fp32", *REQUANTIZED]))
def test_a_target_format_never_hands_its_kernel_a_row_count_outside_one_tile(fmt, monkeypatch):
    """The contract behind the test above on any CPU, whichever kernels it has: the library op of a
    row-independent format only ever sees 2 (1 for the int ops) to ROW_TILE rows, so it cannot switch
    kernels by row count (AMX past 17 rows did)."""
    seen = []
    prepared = prepare(torch.randn(64, 128) * 0.05, fmt, row_independent=True)
    if fmt in ("fp32", "bf16"):
        matmul = prepared._matmul
        prepared._matmul = lambda x, bias: seen.append(x.shape[0]) or matmul(x, bias)
    else:
        module, name = (
            (torch, "_weight_int8pack_mm")
            if fmt == "int8"
            else (torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        )
        op = getattr(module, name)
        monkeypatch.setattr(module, name, lambda x, *args: seen.append(x.shape[0]) or op(x, *args))
    for rows in ENGINE_ROW_COUNTS:
        seen.clear()
        out = prepared(torch.randn(rows, 128).to(ACTIVATION_DTYPE[fmt]), None)
        assert out.shape == (rows, 64) and seen and max(seen) <= ROW_TILE, (rows, seen)
        assert min(seen) >= (2 if fmt in ("fp32", "bf16") else 1), (rows, seen)


def _runner(path: str, fmt: str, blocks: int, positions: int):
    config = EngineConfig.from_kwargs(
        model=path, target_dtype=fmt, speculative_mode="ar", block_size=BLOCK_SIZE, num_threads=1
    )
    return RunnerSpec(
        replace(config.model, path=path), replace(config.cache, num_kv_blocks=blocks), positions
    ).build()


def _logits(
    runner, tokens: list[int], prompt_len: int, step: int, table: list[int]
) -> torch.Tensor:
    """Rows prompt_len - 1 .. len(tokens) - 2 (the logits of tokens[prompt_len:]), computed as a
    prefill of the prompt then `step` tokens at a time (step >= len(tokens): one prefill)."""
    spans = (
        [(0, len(tokens))]
        if step >= len(tokens)
        else [(0, prompt_len)]
        + [(s, min(s + step, len(tokens))) for s in range(prompt_len, len(tokens), step)]
    )
    rows = torch.cat(
        [
            runner.run(StepInputs([a], [tokens[a:b]], [table], [list(range(b - a))]))
            for a, b in spans
        ]
    )
    return rows[prompt_len - 1 : len(tokens) - 1]


# not fp32: the default target keeps today's kernels, where a lone decode row runs oneDNN's one-row
# kernel unless this machine's row-padding table pads it (layers/row_padding.py): at this width its
# logits then differ from a verification row's in the last bits (docs/CPU.md "Target formats")
@pytest.mark.parametrize("fmt", format_params(QUANTIZED))
def test_a_quantized_targets_logits_do_not_depend_on_the_other_rows(tiny_model_dir, fmt):
    path = tiny_model_dir("qwen2", **WIDE)
    tokens, other = PROMPTS[3] + PROMPTS[2][:9], PROMPTS[1] + PROMPTS[0]
    prompt_len = len(PROMPTS[3])
    blocks = -(-len(tokens) // BLOCK_SIZE)
    runner = _runner(path, fmt, 2 * blocks, len(tokens) + K + 2)
    table, other_table = list(range(blocks)), list(range(blocks, 2 * blocks))
    prefill = _logits(runner, tokens, prompt_len, len(tokens), table)
    for step in (1, 2, K + 1):  # decode, and verification-shaped steps
        assert torch.equal(_logits(runner, tokens, prompt_len, step, table), prefill), step
    # the same step in a batch with another sequence (its own blocks): rows of `tokens` unchanged
    runner.run(StepInputs([0], [tokens[:prompt_len]], [table], [[]]))
    batched = runner.run(
        StepInputs(
            [prompt_len, 0],
            [tokens[prompt_len:], other],
            [table, other_table],
            [list(range(len(tokens) - prompt_len)), list(range(len(other)))],
        )
    )
    assert torch.equal(batched[: len(tokens) - prompt_len - 1], prefill[1:])
    # really another model: the weights were re-quantized
    assert not torch.equal(
        prefill,
        _logits(
            _runner(path, "fp32", blocks, len(tokens) + 1), tokens, prompt_len, len(tokens), table
        ),
    )


def test_the_engine_line_names_the_attention_its_layers_run(tiny_model_dir):
    """attention_backend='torch' with a re-quantized CPU target: its layers run the row-independent
    backend (the format's contract above), and the engine line names that one, not the one asked for."""
    with LLM(
        tiny_model_dir("qwen2"), **dict(COMMON, target_dtype="int8", attention_backend="torch")
    ) as llm:
        runner = llm.engine.runner.local
        assert {layer.self_attn.attn.backend for layer in runner.model.model.layers} == {
            row_independent_attention
        }
        assert llm.engine.execution()["attention"] == backend_name(
            row_independent_attention, runner.device
        )


# --------------------------------------------------------------------------- greedy


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    """The tiny qwen2 target and a noisy copy of it as the draft (agrees often, not always)."""
    target = tiny_model_dir("qwen2")
    gen = torch.Generator().manual_seed(1)
    noisy = lambda state: {
        k: v + 0.01 * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v
        for k, v in state.items()
    }
    return target, derived_checkpoint(
        target, str(tmp_path_factory.mktemp("target_dtype_draft")), noisy
    )


def _greedy(target: str, draft: str, fmt: str, mode: str) -> tuple[list[list[int]], dict]:
    options = dict(COMMON, target_dtype=fmt, speculative_mode=mode)
    if mode != "ar":
        options.update(draft_model=draft, num_speculative_tokens=K, draft_dtype="int4")
    if mode == "ssd":
        options.update(ssd_budget=K + 1)  # fixed: no timing of this machine sizes it
    with LLM(target, **options) as llm:
        assert llm.engine.execution()["target_dtype"] == (
            f"{fmt} (re-quantized)" if fmt != "fp32" else "fp32"
        )
        outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return outputs, llm.speculation_metrics()


@pytest.mark.parametrize("mode", ["sd", "ssd"])
@pytest.mark.parametrize("fmt", format_params(QUANTIZED))
def test_greedy_sd_and_ssd_equal_the_quantized_targets_own_ar(pair, fmt, mode):
    target, draft = pair
    ar, _ = _greedy(target, draft, fmt, "ar")
    speculative, metrics = _greedy(target, draft, fmt, mode)
    assert all(len(out) == NEW_TOKENS for out in ar)
    assert speculative == ar
    assert 0 < metrics["acceptance_rate"] < 1, (
        metrics
    )  # accepted drafts and bonus tokens both emitted


# --------------------------------------------------------------------------- T > 0


ALPHA, DESIGN_POWER, SD_TV = 1e-3, 0.8, 0.02
DIST_FORMAT, DIST_K, DIST_N = "int4", 2, 22_000
T1 = dict(temperature=1.0)


def own_law(path: str, fmt: str, prompt: list[int], length: int) -> dict[tuple, float]:
    """{tokens: probability} of the first `length` outputs at T = 1, from the engine's own target in
    format `fmt` (its AR logits: a prefill, then one-token steps), in float64."""
    blocks = -(-(len(prompt) + length) // BLOCK_SIZE)
    runner = _runner(path, fmt, blocks, len(prompt) + length + 1)
    table = list(range(blocks))
    law: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in law.items():
            tokens = prompt + list(prefix)
            runner.run(StepInputs([0], [tokens[:-1]], [table], [[]]))
            row = runner.run(StepInputs([len(tokens) - 1], [tokens[-1:]], [table], [[0]]))[0]
            for token, p in enumerate(torch.softmax(row.double(), dim=-1).tolist()):
                if p > 0:
                    grown[prefix + (token,)] = mass * p
        law = grown
    return law


def test_sd_with_an_int4_target_follows_that_targets_own_law(small_pair):
    target, draft = small_pair
    law = own_law(target, DIST_FORMAT, DIST_PROMPT, 2)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-9)
    with LLM(
        target,
        **engine_options(
            seed=12,
            draft_model=draft,
            speculative_mode="sd",
            target_dtype=DIST_FORMAT,
            num_speculative_tokens=DIST_K,
        ),
    ) as llm:
        engine = llm.engine
        seqs = [
            engine.add_request(DIST_PROMPT, SamplingParams(max_tokens=2, ignore_eos=True, **T1))
            for _ in range(DIST_N)
        ]
        while engine.has_unfinished():
            engine.step()
        metrics = llm.speculation_metrics()
    sample = Counter(tuple(s.output_token_ids) for s in seqs)
    stat, dof, p, n = fit(sample, law)
    power = gof_power(dof, n, SD_TV, ALPHA)
    checkpoint = output_law(
        target, DIST_PROMPT, SamplingParams(max_tokens=2, **T1), 2
    )  # fp64, unquantized
    apart = 0.5 * sum(
        abs(law.get(c, 0.0) - checkpoint.get(c, 0.0)) for c in set(law) | set(checkpoint)
    )
    print(
        f"\nSD [int4 target]: chi2 = {stat:.2f}, dof = {dof}, p = {p:.3g}, n = {n}, power vs TV {SD_TV} = "
        f"{power:.3f}, acceptance = {metrics['acceptance_rate']:.3f}, TV(int4 law, fp32 law) = {apart:.4f}"
    )
    assert (
        0.2 < metrics["acceptance_rate"] < 0.9
    )  # the accept and residual branches both carry mass
    assert dof >= 2 and power >= DESIGN_POWER
    assert p >= ALPHA, (
        f"the emitted law differs from the int4 target's (chi2 = {stat:.1f}, dof = {dof}, p = {p:.2e})"
    )
    # against the unquantized checkpoint's law the same sample fails: the reference is the one that matters
    assert fit(sample, checkpoint)[2] < ALPHA, (
        "int4 changed the law too little for this test to tell"
    )
