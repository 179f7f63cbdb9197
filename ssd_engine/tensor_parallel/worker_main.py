"""`python -m ssd_engine.tensor_parallel.worker_main PARENT_PID ARGS_JSON`: how rank 0 starts each worker process.
A module of its own (imported by nothing) so running it does not import itself twice."""

import signal

if __name__ == "__main__":
    # Ctrl-C reaches the whole group: rank 0 shuts us down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ssd_engine.distributed.lifeline import child_args, exit_done

    args = child_args(
        "tensor-parallel worker"
    )  # before anything slow: from here on we die with rank 0

    from ssd_engine.tensor_parallel.worker import worker_process

    worker_process(**args)
    exit_done()  # the parent's close() waits for this exit: no interpreter teardown
