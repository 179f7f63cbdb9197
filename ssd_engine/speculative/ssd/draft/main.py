"""`python -m ssd_engine.speculative.ssd.draft.main PARENT_PID ARGS_JSON`: the SSD draft process.
A module imported by nothing, so running it does not import itself twice."""

import signal

if __name__ == "__main__":
    # Ctrl-C reaches the whole group: the coordinator stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ssd_engine.distributed.lifeline import child_args, exit_done

    args = child_args("SSD draft")  # before anything slow: from here on we die with the coordinator

    from ssd_engine.speculative.ssd.draft.loop import draft_main

    draft_main(**args)
    exit_done()  # no interpreter teardown
