"""The benchmark suite (benchmarks/bench.py) measures what it says: every mode end to end on tiny
checkpoints (greedy outputs equal across engines, cells and files complete), and its arithmetic
(decode throughput without prefill, batching, the README section) on hand-made numbers."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench  # noqa: E402
from suite import options  # noqa: E402
from suite.measure import Request, batches, cell  # noqa: E402
from suite.report import headline, render  # noqa: E402


def test_decode_throughput_excludes_prefill():
    # two batches of two: decode time is from each batch's last first token to its end
    first = [Request(ttft_s=1.0, latency_s=5.0, tokens=9, token_ids=[]), Request(2.0, 4.0, 5, [])]
    second = [Request(0.5, 2.5, 3, [])]
    c = cell([first, second], wall_s=8.0)
    decode_tokens = 8 + 4 + 2
    assert c["decode_tok_s"] == pytest.approx(decode_tokens / ((5.0 - 2.0) + (2.5 - 0.5)))
    assert c["e2e_tok_s"] == pytest.approx(17 / 8.0)
    assert c["ttft_s"] == pytest.approx(3.5 / 3)
    assert c["tpot_s"] == pytest.approx((4.0 / 8 + 2.0 / 4 + 2.0 / 2) / 3)
    assert c["requests"] == 3 and c["tokens"] == 17


def test_batches_are_always_full():
    assert batches(["a", "b", "c"], 2) == [["a", "b"], ["c", "a"]]
    assert batches(["a", "b"], 4) == [["a", "b", "a", "b"]]
    assert batches(["a", "b", "c"], 1) == [["a"], ["b"], ["c"]]


def test_bad_flags_are_named(tiny_qwen2, capsys):
    for argv, message in ((["--mode", "ar,fast"], "unknown mode 'fast'"),
                          (["--model", tiny_qwen2, "--mode", "sd"], "need --draft too"),
                          (["--model", tiny_qwen2, "--draft", tiny_qwen2, "--mode", "ssd", "--cores", "0",
                            "--draft-cores", "0"], "overlap on [0]"),
                          (["--model", tiny_qwen2, "--k", "0"], "--k needs draft lengths >= 1")):
        with pytest.raises(SystemExit):
            options.parse(argv)
        assert message in capsys.readouterr().err


def test_readme_section_is_replaced_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{bench.README_START}\nold table\n{bench.README_END}\nafter\n")
    raw = {"date": "2026-01-02", "command": "python benchmarks/bench.py", "machine": "m", "placement": "p",
           "prompt_sets": ["code"], "batch": [1], "results": {
               mode: {"rows": [{"mode": mode, "set": "code", "batch": 1, "k": k, "decode_tok_s": v}]}
               for mode, k, v in (("ar", None, 2.0), ("sd", 4, 3.0), ("ssd", 4, 4.5))}}
    bench.update_readme(raw, str(tmp_path / "results" / "2026-01-02-bench"), str(readme))
    text = readme.read_text()
    assert text.startswith("# x\nbefore\n") and text.endswith(f"{bench.README_END}\nafter\n")
    assert "old table" not in text and "| code | 2.00 | 3.00 | 4.50 | 1.50x | 2.25x |" in text
    assert "results/2026-01-02-bench.md" in text


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of every mode on a tiny target and a shallower draft, two prompt sets, batch 1 and 2."""
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_checkpoints import build_checkpoint
    root = tmp_path_factory.mktemp("bench")
    target = build_checkpoint(str(root / "target"), "qwen2", seed=0)
    draft = build_checkpoint(str(root / "draft"), "qwen2", seed=0, num_hidden_layers=1)
    out = root / "results"
    raw = bench.main(["--model", target, "--draft", draft, "--mode", "ar,sd,ssd,hf-ar,hf-assisted",
                      "--prompts", "code,english", "--num-prompts", "2", "--new-tokens", "6", "--batch", "1,2",
                      "--k", "2", "--reps", "1", "--out", str(out), "--tag", "t"])
    return raw, out


def test_every_mode_measures_every_cell_and_greedy_outputs_agree(run):
    raw, _ = run
    results = raw["results"]
    for mode, batch_sizes in (("ar", [1, 2]), ("sd", [1, 2]), ("ssd", [1, 2]), ("hf-ar", [1, 2]), ("hf-assisted", [1])):
        rows = results[mode]["rows"]
        assert sorted((r["set"], r["batch"]) for r in rows) == sorted(
            (s, b) for s in ("code", "english") for b in batch_sizes), mode
        for r in rows:
            assert r["tokens"] == r["requests"] * 6 and r["requests"] == 2
            assert 0 < r["ttft_s"] < r["latency_s"] and r["decode_tok_s"] > 0
            reference = next(a for a in results["ar"]["rows"] if a["set"] == r["set"] and a["batch"] == r["batch"])
            assert r["outputs"] == reference["outputs"], (mode, r["set"], r["batch"])  # greedy: same tokens
        if mode in ("sd", "ssd", "hf-assisted"):
            assert all(r["rounds"] > 0 and 0 <= r["acceptance_rate"] <= 1 for r in rows)
    assert all("cache_hit_rate_warm" in r["ssd"] for r in results["ssd"]["rows"])
    assert results["ssd"]["peaks"]["draft process"] > 0  # the draft process's own peak memory
    assert set(results["sd"]["costs"]["target_forward_s"]) == {1, 3} and results["sd"]["costs"]["draft_step_s"] > 0


def test_files_tables_and_plots_are_written(run):
    raw, out = run
    names = sorted(os.listdir(out))
    stamp = raw["date"]
    assert names == sorted(f"{stamp}-bench-t{suffix}" for suffix in
                           (".md", ".json", "-throughput.png", "-batch.png"))
    saved = json.loads((out / f"{stamp}-bench-t.json").read_text())
    assert saved["machine"].count("commit ") == 1 and "cores [1]" in saved["placement"]
    text = (out / f"{stamp}-bench-t.md").read_text()
    assert text == render(saved)  # the JSON alone reproduces the report
    table = headline(saved, 1)
    assert table["average"]["ssd"] == pytest.approx((table["code"]["ssd"] + table["english"]["ssd"]) / 2)
    assert "| code | " in text and "| average | " in text and "| 2/2 ar |" in text
    assert "hf-assisted is batch 1 only" in text


def test_cuda_flags_place_the_target_on_gpus_and_the_draft_after_them(tiny_qwen2):
    opts = options.parse(["--model", tiny_qwen2, "--draft", tiny_qwen2, "--device", "cuda", "--tp", "2"])
    assert opts.dtype == "bfloat16" and opts.device == "cuda"
    assert "target on GPU 0, 1 (TP 2); SSD draft process on GPU 2" in opts.placement_text()
    cpu = options.parse(["--model", tiny_qwen2, "--draft", tiny_qwen2, "--tp", "2", "--cores", "0,1",
                         "--draft-cores", "2"])
    assert cpu.dtype == "float32" and cpu.placement(with_draft=True) == "0;1;2" and cpu.placement(False) == "0;1"


def test_cuda_kernel_benchmark_smoke_run_on_cpu():
    """The GPU benchmark's code path, on tiny shapes under the Triton interpreter (so it cannot rot
    between GPU loans): every kernel row and every backend / graphs row is produced."""
    pytest.importorskip("triton")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "bench_cuda_kernels.py")
    done = subprocess.run([sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows if r[0].strip() in ("decode", "verify", "tree")] == ["decode", "verify", "tree"]
    engine = [(r[0].strip(), r[1].strip()) for r in rows if r[0].strip() in ("torch", "triton")]
    assert engine == [("torch", "off")] * 2 + [("triton", "off")] * 2 + [("triton", "on")] * 2
    assert all(float(r[3]) > 0 for r in rows if r[0].strip() in ("torch", "triton"))
