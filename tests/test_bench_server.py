"""benchmarks/bench_server.py without running it: flags, and the report's ratio column."""

import bench_server
import pytest


def test_flags_and_the_report():
    a = bench_server.parse(["--mode", "ar, sd", "--new-tokens", "8", "--cores", "1,0"])
    assert a.mode == ["ar", "sd"] and a.cores == [0, 1]
    assert bench_server.engine_flags(a, "ar") == ["--speculative-mode", "ar"]
    with pytest.raises(SystemExit):
        bench_server.parse(["--new-tokens", "1"])
    result = {
        "date": "d",
        "machine": "m",
        "cores": [0],
        "model": "x",
        "new_tokens": 8,
        "repeats": 1,
        "command": "c",
        "modes": {
            "ar": {
                "in_process": {"decode_tok_s": 20.0, "ttft_s": 0.1},
                "server": {"decode_tok_s": 19.0, "ttft_s": 0.2},
            }
        },
    }
    assert "| ar | 20.00 | 19.00 | 0.95 | 0.10 | 0.20 |" in bench_server.markdown(result)
