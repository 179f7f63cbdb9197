"""`/metrics` of several replicas (server/replica_metrics.py), without Ray: the board merges the texts
each replica's own app renders, labels every sample with its replica, and says which replicas are
up and how often each was restarted."""

from prometheus_client.parser import text_string_to_metric_families

from ssd_engine.core.outputs import RequestMetrics, RequestOutput
from ssd_engine.server import replica_metrics
from ssd_engine.server.metrics import ServerMetrics


def _served(requests: int) -> str:
    """One replica's /metrics text after `requests` finished requests of 3 prompt and 5 output tokens."""
    metrics = ServerMetrics()
    for _ in range(requests):
        output = RequestOutput.__new__(RequestOutput)
        output.finish_reason = "length"
        output.metrics = RequestMetrics.__new__(RequestMetrics)
        output.metrics.num_prompt_tokens, output.metrics.num_output_tokens = 3, 5
        output.metrics.ttft_s, output.metrics.e2e_s = 0.1, 0.5
        metrics.finished(output)
    return metrics.render({"acceptance_rate": 0.5}, aborted=0).decode()


def _samples(board: replica_metrics.MetricsBoard) -> dict[tuple, float]:
    text = board.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_replicas_samples_carry_its_label_and_up_and_restarts_are_counted(monkeypatch):
    board = replica_metrics.MetricsBoard()
    board.put(0, 100, _served(2))
    board.put(1, 101, _served(3))
    seen = _samples(board)
    assert seen[("ssd_requests_total", (("finish_reason", "length"), ("replica", "0")))] == 2
    assert seen[("ssd_requests_total", (("finish_reason", "length"), ("replica", "1")))] == 3
    assert seen[("ssd_generation_tokens_total", (("replica", "1"),))] == 15
    assert seen[("ssd_time_to_first_token_seconds_count", (("replica", "0"),))] == 2
    assert seen[("ssd_spec_acceptance_rate", (("replica", "1"),))] == 0.5
    assert {seen[("ssd_replica_up", (("replica", r),))] for r in "01"} == {1.0}
    assert {seen[("ssd_replica_restarts_total", (("replica", r),))] for r in "01"} == {0.0}
    assert all(
        any(k == "replica" for k, _ in labels) for _, labels in seen
    )  # no sample without its replica

    board.put(1, 202, _served(1))  # rank 1 again, from a new process: Ray Serve restarted it
    board.put(1, 202, _served(1))
    seen = _samples(board)
    assert seen[("ssd_replica_restarts_total", (("replica", "1"),))] == 1
    assert seen[("ssd_requests_total", (("finish_reason", "length"), ("replica", "1")))] == 1

    later = replica_metrics.time.monotonic() + replica_metrics.STALE_S + 1
    monkeypatch.setattr(replica_metrics.time, "monotonic", lambda: later)
    board.put(0, 100, _served(2))  # replica 1 went silent
    seen = _samples(board)
    assert (
        seen[("ssd_replica_up", (("replica", "0"),))] == 1
        and seen[("ssd_replica_up", (("replica", "1"),))] == 0
    )


def test_a_replica_pushes_until_told_to_stop():
    import threading

    class Board:
        def __init__(self):
            self.pushed = threading.Event()
            self.put = self

        def remote(self, rank, pid, text):
            assert rank == 3 and text == "x 1.0\n"
            self.pushed.set()

    async def render() -> bytes:
        return b"x 1.0\n"

    board, stop = Board(), threading.Event()
    thread = replica_metrics.push_forever(board, 3, render, stop)
    assert board.pushed.wait(10)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
