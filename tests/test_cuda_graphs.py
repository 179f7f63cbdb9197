"""CUDA graphs' static-buffer path: bucketing, padding rows, buffer reuse, `enforce_eager`.

On CPU the graphs are emulated (SSD_ENGINE_EMULATE_CUDA_GRAPHS=1: the same static buffers, padding
and replay bookkeeping, each replay re-running the forward) over the Triton kernels under the
interpreter; on a CUDA machine the last test captures real graphs.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import hf_oracle  # noqa: E402
from cpu_features import GPU_DRAFT_DTYPE_ON_CPU
from runners import tiny_runner

from ssd_engine import LLM, SamplingParams, testing  # noqa: E402
from ssd_engine.runtime.cuda_graphs import bucket_sizes  # noqa: E402
from ssd_engine.runtime.model_runner import ModelRunner  # noqa: E402
from ssd_engine.runtime.step_inputs import StepInputs  # noqa: E402
from ssd_engine.speculative.ssd.draft.tree_mask import branch_metadata  # noqa: E402

# an object, as the engine names its device: what tests/instrumentation/placement.py takes for the accelerator
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = [list(range(5, 12)), list(range(40, 62)), [7, 8, 9]]  # 3 rows: padded to a graph of 4

# a GPU runs these tests (scripts/gpu_check.sh): each also fails in CI where a host tensor meets the device
CHECK_PLACEMENT = True


@pytest.fixture
def emulated(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setenv(testing.EMULATE_CUDA_GRAPHS, "1")  # the SSD draft process inherits it


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen2", vocab_size=259)


def _expected(path, n):
    return hf_oracle.greedy(path, PROMPTS, n, DEVICE)


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_graphed_engine_matches_transformers(model, emulated, mode):
    n = 16 if mode != "ssd" else 10
    expected = [e[:n] for e in _expected(model, n)]
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    options = dict(
        device=DEVICE.type,
        dtype="float32",
        attention_backend="triton",
        block_size=4,
        cuda_graph_max_batch=32,
    )
    if mode != "ar":
        options.update(
            draft_model=model,
            speculative_mode=mode,
            num_speculative_tokens=3,
            ssd_fanout="1",
            speculation_per_step="off",  # SD verifies every step: the graphs it replays are K + 1's
            ssd_budget=4,
            draft_timeout_s=300,  # fixed: no timing of this machine sizes it
            draft_dtype="bf16" if DEVICE.type == "cuda" else GPU_DRAFT_DTYPE_ON_CPU,
        )
    with LLM(model, **options) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected
        graphs = llm.engine.runner.graphs
        shapes = {key for key, rows in graphs.replayed}
        # AR decodes 1 token per row; SD and SSD verify K + 1 = 4 per row; 3 rows ride a graph of 4
        assert shapes == ({("paged", 1)} if mode == "ar" else {("paged", 4)})
        assert {rows for _, rows in graphs.replayed} >= {4}
        if mode == "sd":
            # the target itself drafting in bf16 (fp32 on a CPU without it) agrees with it (the
            # interpreter's bf16 attention, wrong by ~1e8, once made every draft a miss here:
            # layers/attention_backends.py)
            assert llm.speculation_metrics()["acceptance_rate"] > 0.5
            # its draft steps and its catch-up after a fully accepted round (x_K and the bonus)
            assert {("paged", 1), ("paged", 2)} <= {
                key for key, _ in llm.engine.speculator.runner.graphs.replayed
            }
        if mode == "ssd":
            assert not llm.engine.speculator.metrics.summary()["draft_failures"]


def _runner(model, graphs: int, shapes=(("paged", 1),)) -> ModelRunner:
    runner = tiny_runner(
        model,
        num_kv_blocks=16,
        block_size=4,
        max_position=64,
        device=DEVICE,
        attention_backend="triton",
        graph_max_batch=graphs,
    )
    runner.capture_graphs(list(shapes))  # what the engine does at start-up
    return runner


def _slots_written(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return set(
        (after != before)
        .flatten(0, 1)
        .any(dim=-1)
        .any(dim=-1)
        .any(dim=0)
        .nonzero()
        .flatten()
        .tolist()
    )


def test_padding_rows_write_only_the_padding_slot(model, emulated):
    graphed, eager = _runner(model, 4), _runner(model, 0)
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]
    prefill = StepInputs(
        [0, 0, 0, 0], [[5, 6, 7], [8, 9], [10], [11, 12]], tables, [[2], [1], [0], [1]]
    )
    for runner in (graphed, eager):
        runner.run(prefill)  # ragged: eager
    assert not graphed.graphs.replayed
    steps = [
        StepInputs([3, 2, 1, 2], [[13], [14], [15], [16]], tables, [[0]] * 4),  # 4 rows: graph of 4
        StepInputs([4, 3, 2], [[17], [18], [19]], tables[:3], [[0]] * 3),
    ]  # 3 rows: same graph, padded
    pad_slot = 16 * 4
    for step, new_slots in zip(steps, [{3, 10, 17, 26}, {4 * 1 + 0, 11, 18}]):
        before = graphed.kv_cache.clone()
        logits = graphed.run(step)
        # only each row's new slot and the padding slot change: the 4th row's slot from the step
        # before (still in the static buffer) is not written again
        assert _slots_written(before, graphed.kv_cache) <= new_slots | {pad_slot}
        torch.testing.assert_close(logits, eager.run(step))
    assert list(graphed.graphs.replayed) == [(("paged", 1), 4)]


def test_a_step_filling_its_bucket_goes_in_with_one_copy(model, emulated):
    """A step's ids, positions, slots and key counts leave one upload in the order the static buffer
    holds them: one copy in (one launch on a GPU, were four), the block tables a second, skipped when
    the next step feeds the same tables (an SD draft's steps after its catch-up)."""
    from instrumentation.op_count import OpCounter

    from ssd_engine.runtime.decode_feed import DecodeFeed

    graphed, eager = _runner(model, 4), _runner(model, 0)
    tables = [[0, 1], [2, 3]]
    for runner in (graphed, eager):
        runner.run(StepInputs([0, 0], [[5, 6, 7], [8, 9]], tables, [[2], [1]]))
    ops, fill = OpCounter(), graphed.graphs._fill

    def counted(*args):
        with ops.scope("fill"):
            fill(*args)

    graphed.graphs._fill = counted

    def copies(run):
        before = ops.total("fill", "compute")
        with ops:
            logits = run()
        return ops.total("fill", "compute") - before, logits

    step = StepInputs(
        [3, 2], [[13], [14]], tables, [[0], [0]]
    )  # 2 rows: the graph of 2, no padding
    n, logits = copies(lambda: graphed.run(step))
    assert n == 2
    torch.testing.assert_close(logits, eager.run(step))
    feeds = [DecodeFeed(runner, [4, 3], tables, 2) for runner in (graphed, eager)]
    tokens = torch.tensor([15, 16], device=DEVICE)
    # the drawn ids, [positions | slots | key counts], the tables once
    for s, want in enumerate([3, 2]):
        n, logits = copies(lambda: feeds[0].step(s, tokens))
        assert n == want
        torch.testing.assert_close(logits, feeds[1].step(s, tokens))


def test_only_named_shapes_are_graphed(model, emulated):
    """A uniform prefill (every row feeding the same number of tokens) is not a graph: only the
    shapes the engine named at start-up (here decode) replay."""
    runner = _runner(model, 4)
    tables = [[0, 1], [2, 3]]
    runner.run(StepInputs([0, 0], [[5, 6, 7], [8, 9, 10]], tables, [[2], [2]]))  # 2 rows x 3 tokens
    assert not runner.graphs.replayed
    runner.run(StepInputs([3, 3], [[11], [12]], tables, [[0], [0]]))
    assert list(runner.graphs.replayed) == [(("paged", 1), 2)]


def test_tree_steps_replay_and_match_eager(model, emulated):
    graphed, eager = _runner(model, 8, [("tree", 3)]), _runner(model, 0)
    tables = [[0, 1, 2], [3, 4, 5]]
    prefill = StepInputs([0, 0], [list(range(5, 15)), list(range(20, 27))], tables, [[9], [6]])
    for runner in (graphed, eager):
        runner.run(prefill)
    k, scratch_base = 3, 8 * 4  # branch paths in blocks 8.. (after the trunks)
    seq_of_branch, fork = (
        torch.tensor([0, 0, 1, 1, 1], device=DEVICE),
        [10, 8, 7, 5, 6],
    )  # 5 branches: a graph of 8
    scratch = (scratch_base + torch.arange(5 * k, device=DEVICE)).view(5, k)
    trunk_tables = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([30, 31, 32, 33, 34], device=DEVICE)
    for step in range(k):
        before = graphed.kv_cache.clone()
        meta = lambda: branch_metadata(
            trunk_tables,
            seq_of_branch,
            torch.tensor(fork, device=DEVICE),
            max(fork),
            scratch,
            step,
            4,
        )
        positions = torch.tensor(fork, device=DEVICE) + step
        logits = graphed.run_metadata(ids, positions, meta())
        assert _slots_written(before, graphed.kv_cache) <= set(scratch[:, step].tolist()) | {16 * 4}
        torch.testing.assert_close(logits, eager.run_metadata(ids, positions, meta()))
        ids = logits.argmax(dim=-1)
    assert list(graphed.graphs.replayed) == [(("tree", k), 8)]


def test_enforce_eager_and_the_reference_backend_capture_nothing(model, emulated):
    with LLM(
        model, device=DEVICE.type, dtype="float32", attention_backend="triton", enforce_eager=True
    ) as llm:
        assert llm.engine.runner.graphs is None
    with LLM(model, device=DEVICE.type, dtype="float32", attention_backend="torch") as llm:
        assert llm.engine.runner.graphs is None  # dense masks depend on the data: no graphs


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="captures real CUDA graphs: needs a CUDA GPU"
)
def test_real_cuda_graphs_equal_eager(model):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(
        device="cuda",
        dtype="float32",
        draft_model=model,
        speculative_mode="sd",
        num_speculative_tokens=3,
    )
    with LLM(model, enforce_eager=True, **options) as llm:
        eager = [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    with LLM(model, **options) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == eager
        assert llm.engine.runner.graphs.capture == "cuda" and llm.engine.runner.graphs.graphs


def test_capture_all_then_replay(model, emulated):
    """Start-up capture (what the engine does on a GPU) on empty buffers: every bucket of every named
    shape exists before the first step, reads nothing and writes only the padding slot; later steps
    replay those graphs and equal eager."""
    graphed, eager = _runner(model, 4, []), _runner(model, 0)
    before = graphed.kv_cache.clone()
    graphed.graphs.capture_all([("paged", 1), ("paged", 3), ("tree", 2)])
    assert set(graphed.graphs.graphs) == {
        (key, n) for key in [("paged", 1), ("paged", 3), ("tree", 2)] for n in (1, 2, 4)
    }
    assert _slots_written(before, graphed.kv_cache) <= {16 * 4}
    tables = [[0, 1], [2, 3]]
    prefill = StepInputs([0, 0], [[5, 6, 7], [8, 9]], tables, [[2], [1]])
    verify = StepInputs([3, 2], [[10, 11, 12], [13, 14, 15]], tables, [[0, 1, 2]] * 2)
    for runner in (graphed, eager):
        runner.run(prefill)
    torch.testing.assert_close(graphed.run(verify), eager.run(verify))
    assert len(graphed.graphs.graphs) == 9  # nothing new was captured


@pytest.mark.skipif(
    DEVICE.type == "cuda" and torch.cuda.device_count() < 2,
    reason="two ranks need two GPUs (NCCL links no two ranks on one device)",
)
def test_tensor_parallel_ranks_replay_graphs_in_lockstep(tiny_model_dir, emulated):
    """TP = 2 with graphs (the production GPU shape, here on CPU): every rank picks the same graph for
    each step, so the all-reduces inside the replays meet; greedy output equals transformers'."""
    path = tiny_model_dir("qwen2", vocab_size=321, intermediate_size=131)  # one KV head per rank
    expected = [e[:10] for e in _expected(path, 10)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(
        path,
        device=DEVICE.type,
        dtype="float32",
        attention_backend="triton",
        block_size=4,
        cuda_graph_max_batch=4,
        tensor_parallel_size=2,
        distributed_timeout_s=120,
    ) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected
        assert (("paged", 1), 4) in llm.engine.runner.runner.graphs.replayed
