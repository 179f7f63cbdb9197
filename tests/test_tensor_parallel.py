"""Tensor parallelism on CPU: TP=2 (two processes, gloo, one core each) against TP=1.

Each architecture is built to exercise a different split: Llama with 6 query / 3 KV heads splits by
whole KV groups unevenly (2 groups + 1, like SmolLM2's 9/3), Qwen2 evenly (one KV head each) with an
odd vocabulary and intermediate size (uneven vocab-parallel embedding, LM head and MLP), Qwen3 with
one KV head replicated on both ranks. The real SmolLM2-135M runs the same check. Logits must agree
with TP=1 within 1e-4 (relative to the largest logit when that exceeds 1) and greedy tokens must be
identical (and equal to transformers').

The runtime: two engines at once, a killed worker raising a clear error within a bound, and no
process left behind after close(), after interpreter exit without close(), and after Ctrl-C.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import hf_oracle
import pytest
import torch
from process_helpers import engine_children, gone_within, kill_session, read_line
from runners import tiny_runner
from ssd_engine.kernels import gguf_cpu

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.structures import ScheduledBatch, Sequence
from ssd_engine.distributed.shm_collectives import supported as shm_supported
from ssd_engine.models.loader import load_config
from ssd_engine.runtime.block_manager import BlockManager
from ssd_engine.tensor_parallel.executor import TensorParallelError

TOL = 1e-4
PROMPTS = [
    list(range(5, 12)),
    list(range(40, 53)),
    [7, 8, 9],
    [(7 * i) % 250 + 3 for i in range(37)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SPLITS = {
    "llama": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16),
    "qwen2": dict(vocab_size=321, intermediate_size=131),
    "qwen3": dict(num_key_value_heads=1),
}


def child_pids() -> set[int]:
    """Live children of this process, read from the process table."""
    return engine_children(os.getpid())


def _step_logits(runner, blocks: BlockManager, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of a ragged batched prefill (every position) and then one batched decode step."""
    seqs = [Sequence(p, SamplingParams(), blocks.block_size) for p in prompts]
    for seq in seqs:
        blocks.allocate(seq)
    prefill = runner.forward(
        ScheduledBatch(seqs, [len(p) for p in prompts]), [list(range(len(p))) for p in prompts]
    )
    last = torch.tensor([sum(map(len, prompts[: i + 1])) - 1 for i in range(len(prompts))])
    for seq, token in zip(seqs, prefill[last].argmax(-1).tolist()):
        seq.num_computed_tokens = len(seq)
        seq.token_ids.append(token)
        blocks.grow(seq, len(seq))
    decode = runner.forward(ScheduledBatch(seqs, [1] * len(seqs)), [[0]] * len(seqs))
    for seq in seqs:
        blocks.deallocate(seq)
    return torch.cat([prefill, decode])


def _check_tp2_matches_tp1(path: str, weight_format: str | None = None) -> None:
    """`weight_format`: the target format both engines run (None: the folder's fp32); an exact one, so the
    logits compare with fp32's and greedy with transformers'."""
    config = load_config(path)
    single = tiny_runner(path, config, num_kv_blocks=64, block_size=16, max_position=256)
    expected = _step_logits(single, BlockManager(64, 16, enable_prefix_caching=False), PROMPTS)
    fmt = {} if weight_format is None else {"target_dtype": weight_format}
    with LLM(path, num_threads=1, **fmt) as llm:
        greedy_tp1 = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, **fmt) as llm:
        engine = llm.engine
        assert engine.config.model.weight_format == weight_format
        logits = _step_logits(engine.runner, engine.block_manager, PROMPTS)
        greedy_tp2 = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # 1e-4 relative to the logits' scale: tiny models' logits are below 1 (so 1e-4 absolute), SmolLM2's
    # reach ~35 over 30 layers, where any change of fp32 summation order, our own TP=1 weight
    # prepacking included, moves them by up to ~7e-4 (measured); TP=2 moves them by ~3e-4
    assert (logits - expected).abs().max().item() < TOL * max(1.0, expected.abs().max().item())
    assert greedy_tp2 == greedy_tp1
    assert greedy_tp2 == hf_oracle.greedy(path, PROMPTS, 12)


@pytest.mark.parametrize("arch", sorted(SPLITS))
def test_tp2_matches_tp1_on_tiny_models(tiny_model_dir, arch):
    _check_tp2_matches_tp1(tiny_model_dir(arch, **SPLITS[arch]))


def test_tp2_matches_tp1_with_every_collective_on_gloo(tiny_model_dir, monkeypatch):
    """The shared-memory all-reduce/gather is a fast path; gloo alone must give the same results."""
    monkeypatch.setenv("SSD_ENGINE_TP_SHM", "0")
    _check_tp2_matches_tp1(tiny_model_dir("llama", **SPLITS["llama"]))


def test_shared_memory_collectives_are_used_on_x86(tiny_qwen2):
    if not shm_supported():
        pytest.skip("shared-memory collectives are x86-64 only")
    with LLM(tiny_qwen2, tensor_parallel_size=2) as llm:
        shm = llm.engine.runner.tp.shm
        assert shm is not None
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        assert shm._round > 0  # the forward's all-reduces went through it


def test_tp2_matches_tp1_on_smollm2(smollm2_dir):
    """9 query / 3 KV heads: rank 0 takes 2 KV groups (6 heads), rank 1 one group (3 heads). Its GGUF's
    blocks split whole (o_proj: 384 + 192 columns of 32-value blocks), so each rank keeps its slice's blocks."""
    _check_tp2_matches_tp1(smollm2_dir, "gguf" if gguf_cpu.available() else None)


def test_tp2_speculative_decoding_is_exact(tiny_model_dir):
    """SD with a TP=2 target: the colocated draft on rank 0, the output still the target's greedy."""
    target = tiny_model_dir("qwen2")
    draft = tiny_model_dir("qwen2", seed=1, num_hidden_layers=1)
    with LLM(target, num_threads=1) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(
        target,
        draft_model=draft,
        speculative_mode="sd",
        num_speculative_tokens=3,
        tensor_parallel_size=2,
    ) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_two_engines_at_once_and_no_child_left(tiny_qwen2):
    before = child_pids()
    shm_before = set(os.listdir("/dev/shm"))
    with LLM(tiny_qwen2, num_threads=1) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    first = LLM(tiny_qwen2, tensor_parallel_size=2)
    second = LLM(tiny_qwen2, tensor_parallel_size=2)
    workers = {p.pid for llm in (first, second) for p in llm.engine.runner.processes.values()}
    assert len(workers) == 2 and workers <= child_pids()
    try:
        for prompt, want in zip(PROMPTS, expected):  # interleave requests on the two engines
            assert first.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == want
            assert second.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == want
    finally:
        first.close()
        second.close()
    assert child_pids() == before
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
    # the engine names nothing there (its shared memory is memfds); multiprocessing's semaphores
    # (sem.mp-*) come and go with whatever the other xdist worker runs meanwhile
    assert {
        name for name in set(os.listdir("/dev/shm")) - shm_before if not name.startswith("sem.mp-")
    } == set()


def test_killed_worker_raises_a_clear_error_without_hanging(tiny_qwen2):
    before = child_pids()
    llm = LLM(tiny_qwen2, tensor_parallel_size=2, distributed_timeout_s=10)
    worker = llm.engine.runner.processes[1]
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(
        TensorParallelError, match=rf"worker rank 1 \(pid {worker.pid}\) died with exit code -9"
    ):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10  # detected by the closed connection, not the deadline
    with pytest.raises(TensorParallelError):  # the engine stays failed, loudly
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.close()
    assert child_pids() == before


def test_unsplittable_shape_names_the_sizes_before_spawning(tiny_model_dir):
    path = tiny_model_dir("qwen2")  # 4 query heads, 2 KV heads
    before = child_pids()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3.*num_key_value_heads=2"):
        LLM(path, tensor_parallel_size=3, cpu_cores="0;0;1")
    assert child_pids() == before


def test_rank0_placement_is_restored_after_close(tiny_qwen2):
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with LLM(tiny_qwen2, tensor_parallel_size=2, cpu_cores="1;0") as llm:
        assert os.sched_getaffinity(0) == {1} and torch.get_num_threads() == 1
        worker = llm.engine.runner.processes[1]
        assert os.sched_getaffinity(worker.pid) == {0}
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads


SCRIPT = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background launch leaves SIGINT ignored: a Ctrl-C must land
from ssd_engine import LLM, SamplingParams
llm = LLM({path!r}, tensor_parallel_size=2)
print(" ".join(str(p.pid) for p in llm.engine.runner.processes.values()), flush=True)
if {loop}:
    while True:
        llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
"""


def _run_script(path: str, loop: bool) -> tuple[subprocess.Popen, list[int]]:
    """The script in its own session; callers kill that session by pid in a finally (kill_session)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRIPT.format(path=path, loop=loop))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    workers = [int(pid) for pid in read_line(proc, timeout_s=120).split()]
    if not workers:
        pytest.fail(f"the script started no worker: {kill_session(proc)}")
    return proc, workers


def test_interpreter_exit_without_close_stops_workers(tiny_qwen2):
    proc, workers = _run_script(tiny_qwen2, loop=False)
    try:
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        assert gone_within(workers, 10)
    finally:
        kill_session(proc, workers)


def test_ctrl_c_stops_every_process(tiny_qwen2):
    proc, workers = _run_script(tiny_qwen2, loop=True)
    try:
        time.sleep(1.0)  # let it get into the generate loop
        os.killpg(
            proc.pid, signal.SIGINT
        )  # what a terminal's Ctrl-C does: the whole foreground group
        proc.wait(timeout=60)
        assert "KeyboardInterrupt" in proc.stderr.read()
        assert gone_within(workers, 15)
    finally:
        kill_session(
            proc, workers
        )  # also when an assertion failed: nothing keeps spinning after pytest


def test_torchrun_joins_instead_of_spawning(tiny_qwen2):
    """`torchrun --nproc-per-node 2 -m ssd_engine.generate --tp 2`: rank 0 prints the text, rank 1
    serves it and exits; the text is the TP=1 text. --standalone picks a free rendezvous port."""
    args = [
        "-m",
        "ssd_engine.generate",
        "--model",
        tiny_qwen2,
        "--prompt",
        "hello world",
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "--ignore-eos",
    ]
    single = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    joined = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *args,
            "--tp",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert joined.returncode == 0, joined.stderr
    assert joined.stdout == single.stdout and single.stdout.strip()
    attention = (
        "cpu-kernel" if gguf_cpu.available() else "torch"
    )  # CPU auto's backend (layers/attention_backends.py)
    for run in (single, joined):  # how the target ran, read through the TP runner too
        assert (
            f"[engine] device=cpu dtype=float32 attention={attention} cuda_graphs=off" in run.stderr
        )


def test_each_rank_gets_its_own_gpu_or_a_clear_error():
    from ssd_engine.tensor_parallel.launch import rank_gpus

    assert rank_gpus("cuda", 2, 2) == ["cuda:0", "cuda:1"]
    assert rank_gpus("cuda:1", 2, 4) == ["cuda:1", "cuda:2"]
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 from cuda needs GPUs cuda:0..cuda:1; this machine has 1",
    ):
        rank_gpus("cuda", 2, 1)
