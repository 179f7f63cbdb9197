"""No child outlives a SIGKILLed engine: the SSD draft process and the tensor-parallel workers die
with the engine process in every phase (interpreter start-up, model loading, generation).

Each case runs an engine script in its own session, SIGKILLs the script at one moment and checks the
children's pids in the process table: gone (or a zombie) within a few seconds. However a case ends,
its whole session is killed by pid, so a failure leaves nothing running. And the converse: children
of an engine built on a thread that then ends live on, and Ctrl-C in the CLI stops everything
with one line.
"""

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from process_helpers import (
    alive,
    descendants_of,
    engine_children,
    gone_within,
    kill_session,
    read_line,
    wait_for_children,
)

SCRIPT = """
import sys
from ssd_engine import LLM, SamplingParams
kind, target, draft = sys.argv[1:]
options = {"ssd": dict(speculative_mode="ssd", draft_model=draft), "tp": dict(tensor_parallel_size=2),
           "ssd+tp": dict(speculative_mode="ssd", draft_model=draft, tensor_parallel_size=2)}[kind]
llm = LLM(target, num_threads=1, max_num_seqs=2, num_kv_blocks=64, **options)
print("generating", flush=True)
while True:
    llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
"""
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def draft(tiny_model_dir):
    return tiny_model_dir("qwen2", seed=1)


# "start-up": SIGKILL as soon as the child's pid exists (it has not run a line of ours yet);
# "loading": half a second later (still importing torch / loading); "generating": while the draft
# and a worker both serve (one engine with both, to keep the slowest case single).
@pytest.mark.parametrize(
    "kind, moment",
    [
        ("ssd", "start-up"),
        ("ssd", "loading"),
        ("tp", "start-up"),
        ("tp", "loading"),
        ("ssd+tp", "generating"),
    ],
)
def test_children_die_with_a_killed_engine(kind, moment, tiny_qwen2, draft):
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), kind, tiny_qwen2, draft],
        env=ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children = set()
    try:
        children = wait_for_children(
            proc.pid, 1, timeout_s=60, every_process=True
        )  # the fork server, first
        assert children, "the engine started no child"
        if moment == "loading":
            time.sleep(0.5)
        elif moment == "generating":
            assert read_line(proc, timeout_s=60) == "generating\n"
            assert len(wait_for_children(proc.pid, 2, timeout_s=1)) == 2  # the draft and the worker
            time.sleep(0.3)
        children |= descendants_of(proc.pid)
        assert alive(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert gone_within(children, 5), (
            f"children {sorted(children)} outlived the engine ({moment})"
        )
    finally:
        kill_session(proc, children)


def test_an_engine_built_on_a_thread_that_ends_keeps_its_children(tiny_qwen2):
    """The kernel signals a child when the parent *thread* that forked it exits: an engine built
    on a short-lived thread must still have its worker afterwards."""
    from ssd_engine import LLM, SamplingParams

    built = {}
    thread = threading.Thread(
        target=lambda: built.update(llm=LLM(tiny_qwen2, tensor_parallel_size=2, num_threads=1))
    )
    thread.start()
    thread.join()
    llm = built["llm"]
    try:
        worker = llm.engine.runner.processes[1].pid
        time.sleep(0.5)
        assert alive(worker)
        out = llm.generate(
            [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        assert len(out[0].token_ids) == 4
    finally:
        llm.close()


# A shell that starts a job in the background ignores SIGINT for it, and the child inherits that:
# restore Python's handler so the test sends a Ctrl-C the child can actually receive.
WITH_SIGINT = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('ssd_engine.generate', run_name='__main__', alter_sys=True)"
)


def test_ctrl_c_in_the_cli_prints_one_line_and_leaves_no_child(tiny_qwen2, draft):
    args = [
        "--model",
        tiny_qwen2,
        "--draft-model",
        draft,
        "--mode",
        "ssd",
        "--tp",
        "2",
        "--num-threads",
        "1",
        "--num-kv-blocks",
        "64",
        "--prompt",
        "abc",
        "--max-tokens",
        "480",
        "--ignore-eos",
        "--stream",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", WITH_SIGINT, *args],
        env=ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children = set()
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "no text streamed"
        assert len(engine_children(proc.pid)) == 2  # the draft and one worker, both serving
        children = descendants_of(proc.pid)
        os.killpg(
            proc.pid, signal.SIGINT
        )  # what a terminal's Ctrl-C does: the whole foreground group
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted", err
        assert gone_within(children, 5)
    finally:
        kill_session(proc, children)
