"""Our model code against transformers' on the same checkpoint: logits within 1e-4 (fp32).

Covers Llama (llama3 rope_scaling, GQA, tied embeddings), Qwen2 (qkv bias), Qwen3 (q/k norm),
with plain and prepacked weights, for a batched prefill of ragged prompts followed by a batched
decode step reading K/V back through the block tables; and the real SmolLM2-135M checkpoint.
"""

import pytest
import torch
from runners import tiny_runner
from transformers import AutoModelForCausalLM

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.structures import ScheduledBatch, Sequence
from ssd_engine.models.loader import config_from_values, config_values, load_config
from ssd_engine.runtime.block_manager import BlockManager

TOL = 1e-4


def _compare(
    path: str, prompts: list[list[int]], pack: bool, block_size: int = 4
) -> tuple[float, float]:
    """Max |ours - transformers| over every prefill position, then over one decode step."""
    config = load_config(path)
    runner = tiny_runner(
        path, config, num_kv_blocks=256, block_size=block_size, max_position=512, weight_layout=pack
    )
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    blocks = BlockManager(256, block_size, enable_prefix_caching=False)
    seqs = [Sequence(p, SamplingParams(), block_size) for p in prompts]
    for seq in seqs:
        blocks.allocate(seq)
    prefill = runner.forward(
        ScheduledBatch(seqs, [len(p) for p in prompts]), [list(range(len(p))) for p in prompts]
    )
    with torch.no_grad():
        expected = torch.cat([oracle(torch.tensor([p])).logits[0] for p in prompts])
    prefill_err = (prefill - expected).abs().max().item()

    next_tokens = [
        int(t)
        for t in expected.view(-1, expected.shape[-1])[
            [sum(map(len, prompts[: i + 1])) - 1 for i in range(len(prompts))]
        ].argmax(-1)
    ]
    for seq, token in zip(seqs, next_tokens):
        seq.num_computed_tokens = len(seq)
        seq.token_ids.append(token)
        blocks.grow(seq, len(seq))
    decode = runner.forward(ScheduledBatch(seqs, [1] * len(seqs)), [[0]] * len(seqs))
    with torch.no_grad():
        expected = torch.stack(
            [oracle(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(prompts, next_tokens)]
        )
    return prefill_err, (decode - expected).abs().max().item()


@pytest.mark.parametrize("pack", ["plain", "packed", "dual"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_logits_match_transformers(tiny_model_dir, arch, pack):
    prompts = [list(range(5, 12)), list(range(40, 53)), [7, 8, 9]]
    prefill_err, decode_err = _compare(tiny_model_dir(arch), prompts, pack)
    assert prefill_err < TOL and decode_err < TOL, (prefill_err, decode_err)


def test_llama3_rope_scaling_is_exercised(tiny_llama):
    """Positions past original_max_position_embeddings (64) hit the scaled frequencies."""
    prompts = [[(i * 7) % 250 + 3 for i in range(150)]]
    prefill_err, decode_err = _compare(tiny_llama, prompts, pack="dual", block_size=16)
    assert prefill_err < TOL and decode_err < TOL, (prefill_err, decode_err)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_child_process_builds_the_same_model_from_plain_config_values(tiny_model_dir, arch):
    """Tensor-parallel workers and the SSD draft build from `config_values` without transformers;
    the llama checkpoint's llama3 rope rebuilds transformers' config for its frequencies."""
    path = tiny_model_dir(arch)
    values = config_values(load_config(path))
    prompts = [list(range(5, 80))]
    logits = []
    for config in (load_config(path), config_from_values(values)):
        runner = tiny_runner(path, config, num_kv_blocks=64, block_size=16, max_position=512)
        blocks = BlockManager(64, 16, enable_prefix_caching=False)
        seqs = [Sequence(p, SamplingParams(), 16) for p in prompts]
        for seq in seqs:
            blocks.allocate(seq)
        logits.append(
            runner.forward(
                ScheduledBatch(seqs, [len(p) for p in prompts]),
                [list(range(len(p))) for p in prompts],
            )
        )
    assert torch.equal(logits[0], logits[1])
    assert config_values(config_from_values(values)) == values


def test_smollm2_logits_match_transformers(smollm2_dir):
    prompts = [[1, 504, 3458, 28, 1029, 253, 1380, 30], [1, 1976, 42, 19]]
    prefill_err, decode_err = _compare(smollm2_dir, prompts, pack="dual", block_size=16)
    assert prefill_err < TOL and decode_err < TOL, (prefill_err, decode_err)
