"""Piecewise graphs (runtime/piecewise_graphs.py): steps no whole-step graph holds (prefill chunks,
prefill batched with decode rows) replay the work between attentions from graphs per token bucket.

On CPU the graphs are emulated (SSD_ENGINE_EMULATE_CUDA_GRAPHS=1) over the Triton kernels under the
interpreter; on a CUDA machine (scripts/gpu_check.sh) they are captured for real.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import hf_oracle  # noqa: E402
from runners import tiny_runner

from ssd_engine import LLM, SamplingParams, testing  # noqa: E402
from ssd_engine.runtime import piecewise_graphs  # noqa: E402
from ssd_engine.runtime.model_runner import ModelRunner  # noqa: E402
from ssd_engine.runtime.piecewise_graphs import SMALLEST, token_buckets  # noqa: E402
from ssd_engine.runtime.step_inputs import StepInputs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHECK_PLACEMENT = True  # a GPU runs these tests: a host tensor meeting the device fails in CI too


@pytest.fixture
def emulated(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setenv(testing.EMULATE_CUDA_GRAPHS, "1")


def test_token_buckets_pad_under_a_quarter_or_8_rows():
    sizes = token_buckets(512)
    assert sizes[:4] == [8, 16, 24, 32] and sizes[-1] == 512 and sizes == sorted(set(sizes))
    for tokens in range(1, 513):
        bucket = next(n for n in sizes if n >= tokens)
        assert bucket - tokens < max(SMALLEST, tokens / 4), tokens
    assert token_buckets(100)[-1] == 100 and token_buckets(8) == [8]


def _runner(model, graphs: int, fused: str) -> ModelRunner:
    return tiny_runner(
        model,
        num_kv_blocks=64,
        block_size=4,
        max_position=256,
        device=DEVICE,
        attention_backend="triton",
        graph_max_batch=graphs,
        fused_kernels=fused,
    )


@pytest.mark.parametrize("fused", ["on", "off"])
def test_ragged_steps_replay_pieces_and_match_eager(tiny_model_dir, emulated, fused):
    """A ragged prefill, then a step mixing a prefill chunk with decode rows: both replay the
    pieces of their buckets (padded), write the same K/V and give the same logits as eager."""
    model = tiny_model_dir("qwen3")  # per-head q/k norms: the most a layer's cut must carry
    graphed, eager = _runner(model, 4, fused), _runner(model, 0, fused)
    assert eager.piecewise is None
    graphed.capture_graphs([("paged", 1)])
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    prefill = StepInputs(
        [0, 0], [list(range(5, 14)), list(range(30, 35))], tables[:2], [[8], [3, 4]]
    )
    mixed = StepInputs([9, 5, 0], [[40], [41], list(range(50, 63))], tables, [[0], [0], [12]])
    outputs = []
    for step, bucket in ((prefill, 16), (mixed, 16)):
        before = graphed.kv_cache.clone()
        logits = graphed.run(step)
        expected = eager.run(step)
        torch.testing.assert_close(logits, expected)
        written = (graphed.kv_cache != before).any(dim=-1).any(dim=-1).any(dim=1).any(dim=0)
        assert written.sum().item() == sum(
            len(fed) for fed in step.token_ids
        )  # padding rows write no K/V
        torch.testing.assert_close(
            graphed.kv_cache[:, :, : eager.kv_cache.shape[2]], eager.kv_cache
        )  # + a padding block
        outputs.append(graphed.piecewise.outputs[bucket].data_ptr())
    assert graphed.piecewise.replayed == {16: 2}
    assert (
        outputs[0] == outputs[1]
    )  # one output buffer a bucket, rewritten by each replay, as a real graph's
    decode = StepInputs([10, 6, 13], [[70], [71], [72]], tables, [[0]] * 3)
    torch.testing.assert_close(graphed.run(decode), eager.run(decode))
    assert graphed.piecewise.replayed == {16: 2}  # a uniform decode step is the whole-step graph's


def test_steps_wider_than_the_largest_bucket_run_eagerly(tiny_model_dir, emulated, monkeypatch):
    monkeypatch.setattr(piecewise_graphs, "MAX_TOKENS", 16)
    runner = _runner(tiny_model_dir("qwen2"), 4, "on")
    assert runner.piecewise.sizes == [8, 16]
    runner.run(StepInputs([0], [list(range(5, 22))], [[0, 1, 2, 3, 4]], [[16]]))  # 17 tokens
    assert runner.piecewise.replayed == {}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_with_piecewise_prefill_matches_transformers(tiny_model_dir, emulated, arch):
    """Chunked prefill (16 tokens a step) of prompts longer than a chunk, batched with decode rows:
    greedy output equals transformers'."""
    model = tiny_model_dir(arch)
    prompts = [list(range(5, 12)), list(range(40, 77)), [7, 8, 9] * 7]
    expected = hf_oracle.greedy(model, prompts, 8, DEVICE)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(
        model,
        device=DEVICE.type,
        dtype="float32",
        attention_backend="triton",
        block_size=4,
        max_num_batched_tokens=16,
        cuda_graph_max_batch=4,
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
        assert (
            sum(llm.engine.runner.piecewise.replayed.values()) >= 4
        )  # 65 prompt tokens, 16 a step
