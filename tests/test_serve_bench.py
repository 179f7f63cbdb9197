"""benchmarks/serve_bench.py without a load generator or a server: flags, the servers' command lines,
the levels, guidellm's report read into a row, and the table."""

import pytest
import serve_bench


def _report(tok_s: float) -> dict:
    """The fields serve_bench reads from a guidellm 0.8 benchmark record."""
    stat = {"successful": {"mean": 1.0, "percentiles": {"p50": 100.0, "p99": 300.0}}}
    return {
        "metrics": {
            "output_tokens_per_second": {"successful": {"mean": tok_s}},
            "requests_per_second": {"successful": {"mean": 0.5}},
            "request_totals": {"successful": 8, "errored": 0},
            "prompt_token_count": {"successful": {"mean": 450.0}},
            "output_token_count": {"successful": {"mean": 64.0}},
            **{key: stat for key in serve_bench.METRICS.values()},
        }
    }


def test_flags_levels_and_server_command_lines():
    a = serve_bench.parse(
        [
            "--servers",
            "ar,auto+goodput",
            "--concurrency",
            "1,4",
            "--rates",
            "0.5",
            "--prompt-tokens",
            "128",
            "--cores",
            "1,0",
            "--guidellm",
            "/bin/true",
        ]
    )
    assert a.servers == ["ar", "auto+goodput"] and a.cores == [1, 0] and a.prompt_tokens == [128]
    assert serve_bench.levels(a) == [
        ("concurrent@1", "kind=concurrent,streams=1", 6),
        ("concurrent@4", "kind=concurrent,streams=4", 8),
        ("poisson@0.5", "kind=poisson,rate=0.5", 8),
    ]
    ours = serve_bench.server_argv(a, "auto+goodput", 1234)
    assert ours[:3] == ["taskset", "-c", "1,0"] and ours[-2:] == [
        "--speculation-per-step",
        "goodput",
    ]
    assert ours[ours.index("--speculative-mode") + 1] == "auto" and "--draft-model" not in ours
    with pytest.raises(SystemExit):  # llama.cpp's server named without its binary
        serve_bench.parse(
            ["--servers", "llamacpp", "--guidellm", "/bin/true", "--llama-server", ""]
        )


def test_a_guidellm_record_becomes_a_row_and_the_table_shows_every_server():
    row = serve_bench.summarize(_report(12.5))
    assert (
        row["output_tok_s"] == 12.5
        and row["ttft_ms"] == {"p50": 100.0, "p99": 300.0}
        and row["errored"] == 0
    )
    result = {
        "date": "d",
        "machine": "m",
        "cores": [0, 1],
        "model": "x",
        "servers": ["ar", "llamacpp"],
        "output_tokens": 64,
        "command": "c",
        "cells": {
            "450": {"concurrent@4": {"ar": row, "llamacpp": serve_bench.summarize(_report(20.0))}}
        },
    }
    table = serve_bench.markdown(result)
    assert (
        "| concurrent@4 | 12.50 | 20.00 | 0.1 / 0.3 | 0.1 / 0.3 | 100 / 300 | 100 / 300 |" in table
    )
