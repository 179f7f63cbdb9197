"""benchmarks/gpu/bench_anchor.py on CPU: our AR and transformers' generate on one random-weight model,
each producing exactly the asked tokens, reported side by side with the ratio the GPU goal reads."""

import json

from gpu import bench_anchor


def test_anchor_table(tiny_qwen2, tmp_path):
    result = bench_anchor.main(
        [
            "--model",
            tiny_qwen2,
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--hf",
            "dynamic",
            "--out",
            str(tmp_path),
        ]
    )
    assert set(result["runs"]) == {"ours", "hf-dynamic"}
    for rate in result["runs"].values():
        assert rate["decode_tok_s"] > 0 and rate["e2e_tok_s"] > 0
    (md,) = tmp_path.glob("*-anchor-cpu.md")
    rows = [line for line in md.read_text().splitlines() if line.startswith(("| ours", "| hf-"))]
    assert len(rows) == 2
    ratio = float(rows[1].strip("|").split("|")[3])
    want = result["runs"]["ours"]["decode_tok_s"] / result["runs"]["hf-dynamic"]["decode_tok_s"]
    assert abs(ratio - want) <= 0.006
    (saved,) = tmp_path.glob("*-anchor-cpu.json")
    assert json.loads(saved.read_text())["runs"] == result["runs"]


def test_bad_runner_named():
    import pytest

    with pytest.raises(SystemExit):
        bench_anchor.parse(["--hf", "static,eager"])
