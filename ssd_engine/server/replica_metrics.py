"""`/metrics` of `serve --data-parallel-size N`: every replica's metrics in one scrape, each sample
labelled with its `replica` (Ray Serve rank), plus `ssd_replica_up` and `ssd_replica_restarts`.
Replicas push every PUSH_S to one `MetricsBoard`; up while the last push is younger than STALE_S; a
rank pushing from a new pid counts one restart. Counters are per process, as rate() expects."""

import asyncio
import os
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

PUSH_S = 1.0
STALE_S = 5.0


class MetricsBoard:
    """The replicas' latest metrics (run as one Ray actor; plain Python otherwise, as in tests)."""

    def __init__(self) -> None:
        self.latest: dict[
            int, tuple[int, float, str]
        ] = {}  # rank -> (pid, when pushed, exposition text)
        self.restarts: dict[int, int] = {}

    def put(self, rank: int, pid: int, text: str) -> None:
        if rank in self.latest and self.latest[rank][0] != pid:
            self.restarts[rank] = self.restarts.get(rank, 0) + 1
        self.latest[rank] = (pid, time.monotonic(), text)

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(dict(self.latest), dict(self.restarts)))
        return generate_latest(registry)


class _Merged:
    def __init__(self, latest: dict[int, tuple[int, float, str]], restarts: dict[int, int]) -> None:
        self.latest, self.restarts = latest, restarts

    def collect(self):
        merged: dict[str, Metric] = {}
        for rank, (_, _, text) in sorted(self.latest.items()):
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    into.add_sample(
                        sample.name,
                        {**sample.labels, "replica": str(rank)},
                        sample.value,
                        sample.timestamp,
                    )
        yield from merged.values()
        now = time.monotonic()
        up = GaugeMetricFamily(
            "ssd_replica_up", "1 while the replica reports its metrics", labels=["replica"]
        )
        restarts = CounterMetricFamily(
            "ssd_replica_restarts", "Replica processes Ray Serve started again", labels=["replica"]
        )
        for rank, (_, pushed, _) in sorted(self.latest.items()):
            up.add_metric([str(rank)], float(now - pushed < STALE_S))
            restarts.add_metric([str(rank)], float(self.restarts.get(rank, 0)))
        yield up
        yield restarts


def push_forever(board, rank: int, render, stop: threading.Event) -> threading.Thread:
    """A daemon thread sending `await render()` (this replica's exposition, bytes) to `board` every
    PUSH_S until `stop` is set; a failed render or send is retried at the next push."""

    def run() -> None:
        loop = asyncio.new_event_loop()
        try:
            while not stop.is_set():
                try:
                    board.put.remote(rank, os.getpid(), loop.run_until_complete(render()).decode())
                # the board or the engine is going away: the next push says so or stops
                except Exception:
                    pass
                stop.wait(PUSH_S)
        finally:
            loop.close()

    thread = threading.Thread(target=run, name=f"metrics-push-{rank}", daemon=True)
    thread.start()
    return thread
