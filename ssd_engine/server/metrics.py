"""`/metrics` in Prometheus text format (prometheus_client, one registry per server, so several
servers in one process never collide): request counts, tokens, TTFT / TPOT histograms, and at
scrape time the engine's speculation metrics (acceptance, steps by chosen K, cache hits, fallbacks,
draft failures)."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ssd_engine.core.outputs import RequestOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ssd_requests", "Finished requests, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "ssd_rejected_requests",
            "Requests answered with an error, by HTTP status",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ssd_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "ssd_generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.ttft = Histogram(
            "ssd_time_to_first_token_seconds",
            "Arrival to first output token",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "ssd_time_per_output_token_seconds",
            "Decode time per output token after the first",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.snapshot: dict = {}
        self.aborted = 0
        r.register(_Speculation(self))

    def finished(self, output: RequestOutput) -> None:
        m = output.metrics
        self.requests.labels(output.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        self.ttft.observe(m.ttft_s)
        if m.num_output_tokens > 1:
            self.tpot.observe((m.e2e_s - m.ttft_s) / (m.num_output_tokens - 1))

    def render(self, snapshot: dict, aborted: int) -> bytes:
        self.snapshot, self.aborted = snapshot, aborted
        return generate_latest(self.registry)


class _Speculation:
    """Reads the engine's speculation summary taken for this scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        s = self.metrics.snapshot
        aborted = CounterMetricFamily(
            "ssd_aborted_requests", "Requests cancelled because the client went away"
        )
        aborted.add_metric([], self.metrics.aborted)
        yield aborted
        for name, key, text in (
            ("ssd_spec_acceptance_rate", "acceptance_rate", "Accepted / drafted tokens"),
            (
                "ssd_spec_mean_acceptance_length",
                "mean_acceptance_length",
                "Tokens per verification round, bonus included",
            ),
            ("ssd_cache_hit_rate", "cache_hit_rate", "SSD speculation-cache hit rate"),
        ):
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], float(s.get(key) or 0.0))
            yield gauge
        for name, key, text in (
            ("ssd_spec_drafted_tokens", "drafted", "Draft tokens proposed"),
            ("ssd_spec_accepted_tokens", "accepted", "Draft tokens accepted"),
        ):
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], float(s.get(key) or 0))
            yield counter
        fallbacks = CounterMetricFamily(
            "ssd_fallback_rounds", "SSD rounds served by a backup speculator", labels=["backup"]
        )
        for backup, rounds in (s.get("backup_rounds") or {}).items():
            fallbacks.add_metric([backup], float(rounds))
        yield fallbacks
        steps = CounterMetricFamily(
            "ssd_spec_steps",
            "Engine steps by the K they drafted (SD's choice each step; 0: plain decoding)",
            labels=["k"],
        )
        for k, count in (s.get("steps_by_k") or {}).items():
            steps.add_metric([str(k)], float(count))
        yield steps
        failures = CounterMetricFamily(
            "ssd_draft_failures", "Draft process failures (the engine fell back and went on)"
        )
        failures.add_metric([], float(len(s.get("draft_failures") or [])))
        yield failures
