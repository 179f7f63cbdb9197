"""The benchmark suite (benchmarks/bench.py) measures what it says: every mode end to end on tiny
checkpoints (greedy outputs equal across engines, cells and files complete), and its arithmetic
(decode throughput without prefill, batching, the README section) on hand-made numbers."""

import json
import math
import os
import pickle
import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import bench
import pytest
import torch
from suite import host_speed, isolate, options, ours
from suite.goals import goal_lines
from suite.machine import machine_line
from suite.measure import Request, batches, cell
from suite.report import (
    detail_lines,
    efficiency_lines,
    headline,
    headline_lines,
    render,
    round_efficiency,
    rows_of,
)

from ssd_engine.layers.weight_formats import FORMATS


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
    for argv, message in (
        (["--mode", "ar,fast"], "unknown mode 'fast'"),
        (["--model", tiny_qwen2, "--mode", "sd"], "need --draft too"),
        (
            [
                "--model",
                tiny_qwen2,
                "--draft",
                tiny_qwen2,
                "--mode",
                "ssd",
                "--cores",
                "0",
                "--draft-cores",
                "0",
            ],
            "overlap on [0]",
        ),
        (
            ["--model", tiny_qwen2, "--draft", tiny_qwen2, "--mode", "auto", "--draft-cores", "0"],
            "overlap on [0]",
        ),  # auto may split the cores for SSD: they must be disjoint
        (["--model", tiny_qwen2, "--draft-dtype", "int3"], "invalid choice: 'int3'"),
        (
            [
                "--model",
                tiny_qwen2,
                "--draft",
                tiny_qwen2,
                "--device",
                "cuda",
                "--draft-dtype",
                "int4",
            ],
            "int4 is CPU-only",
        ),
        (["--model", tiny_qwen2, "--k", "0"], "--k needs draft lengths >= 1"),
    ):
        with pytest.raises(SystemExit):
            options.parse(argv)
        assert message in capsys.readouterr().err


def test_readme_section_is_replaced_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{bench.README_START}\nold table\n{bench.README_END}\nafter\n")
    raw = {
        "date": "2026-01-02",
        "command": "python benchmarks/bench.py",
        "machine": "m",
        "placement": "p",
        "prompt_sets": ["code"],
        "batch": [1],
        "results": {
            mode: {"rows": [{"mode": mode, "set": "code", "batch": 1, "k": k, "decode_tok_s": v}]}
            for mode, k, v in (("ar", None, 2.0), ("sd", 4, 3.0), ("ssd", 4, 4.5))
        },
    }
    bench.update_readme(raw, str(tmp_path / "results" / "2026-01-02-bench"), str(readme))
    text = readme.read_text()
    assert text.startswith("# x\nbefore\n") and text.endswith(f"{bench.README_END}\nafter\n")
    assert "old table" not in text and "| code | 2.00 | 3.00 | 4.50 | 1.50x | 2.25x |" in text
    assert "results/2026-01-02-bench.md" in text


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of every mode on a tiny target and a shallower draft, two prompt sets, batch 1 and 2
    (`auto` once the engine has that mode). xdist deals the suite's first tests out one by one, so
    this module's two users land on both workers: the first to get here runs it, the other waits
    and reads its result: two runs at once would repeat ~40 s of work, pinned to the same cores."""
    from filelock import FileLock  # transformers' own dependency

    base = tmp_path_factory.getbasetemp()
    shared = (
        base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    )  # one folder per session
    root = shared / "bench-every-mode"
    with FileLock(str(shared / "bench-every-mode.lock")):
        if not (root / "raw.pickle").exists():
            raw = _run_every_mode(root)
            (root / "raw.pickle").write_bytes(pickle.dumps(raw))
    return pickle.loads((root / "raw.pickle").read_bytes()), root / "results"


def _run_every_mode(root) -> dict:
    from tiny_checkpoints import build_checkpoint

    target = build_checkpoint(str(root / "target"), "qwen2", seed=0)
    draft = build_checkpoint(str(root / "draft"), "qwen2", seed=0, num_hidden_layers=1)
    out = root / "results"
    from ssd_engine.core.option_choices import SPECULATIVE_MODES

    modes = "ar,sd,sd-all,ssd,hf-ar,hf-assisted" + (",auto" if "auto" in SPECULATIVE_MODES else "")
    raw = bench.main(
        [
            "--model",
            target,
            "--draft",
            draft,
            "--mode",
            modes,
            "--prompts",
            "code,english",
            "--num-prompts",
            "2",
            "--new-tokens",
            "6",
            "--batch",
            "1,2",
            "--k",
            "2",
            "--reps",
            "1",
            "--out",
            str(out),
            "--tag",
            "t",
        ]
    )
    return raw


def test_every_mode_measures_every_cell_and_greedy_outputs_agree(run):
    raw, _ = run
    results = raw["results"]
    for mode, batch_sizes in (
        ("ar", [1, 2]),
        ("sd", [1, 2]),
        ("sd-all", [1, 2]),
        ("ssd", [1, 2]),
        ("auto", [1, 2]),
        ("hf-ar", [1, 2]),
        ("hf-assisted", [1]),
    ):
        if mode not in results:
            assert mode == "auto"  # an engine without auto mode yet
            continue
        rows = results[mode]["rows"]
        assert sorted((r["set"], r["batch"]) for r in rows) == sorted(
            (s, b) for s in ("code", "english") for b in batch_sizes
        ), mode
        for r in rows:
            assert r["tokens"] == r["requests"] * 6 and r["requests"] == 2
            assert 0 < r["ttft_s"] < r["latency_s"] and r["decode_tok_s"] > 0
            reference = next(
                a
                for a in results["ar"]["rows"]
                if a["set"] == r["set"] and a["batch"] == r["batch"]
            )
            assert r["outputs"] == reference["outputs"], (
                mode,
                r["set"],
                r["batch"],
            )  # greedy: same tokens
        if mode in ("sd", "sd-all", "ssd", "hf-assisted"):
            assert all(r["rounds"] > 0 and 0 <= r["acceptance_rate"] <= 1 for r in rows)
        if mode in ("sd", "sd-all", "ssd"):
            assert {r["draft_format"] for r in rows} <= set(
                FORMATS
            )  # the probe's pick varies by CPU
        if mode == "auto":
            assert all(
                r["chosen_mode"] in ("ar", "sd", "ssd") and r["k"] == r["chosen_k"] for r in rows
            )
    assert all("cache_hit_rate_warm" in r["ssd"] for r in results["ssd"]["rows"])
    assert results["ssd"]["peaks"]["draft process"] > 0  # the draft process's own peak memory
    assert (
        set(results["sd"]["costs"]["target_forward_s"]) == {1, 3}
        and results["sd"]["costs"]["draft_step_s"] > 0
    )


def test_files_tables_and_plots_are_written(run):
    raw, out = run
    names = sorted(os.listdir(out))
    stamp = raw["date"]
    assert names == sorted(
        f"{stamp}-bench-t{suffix}" for suffix in (".md", ".json", "-throughput.png", "-batch.png")
    )
    saved = json.loads((out / f"{stamp}-bench-t.json").read_text())
    assert saved["machine"].count("commit ") == 1 and "cores [1]" in saved["placement"]
    assert saved["cpu"]["visible_cores"] == os.cpu_count() and saved["machine"].startswith(
        saved["cpu"]["cpu_model"]
    )
    assert "; host speed before / after the run: fp32 GEMM " in saved["machine"]
    assert set(saved["host_speed"]) == {"before", "after"}
    text = (out / f"{stamp}-bench-t.md").read_text()
    assert text == render(saved)  # the JSON alone reproduces the report
    table = headline(saved, 1)
    assert table["average"]["ssd"] == pytest.approx(
        (table["code"]["ssd"] + table["english"]["ssd"]) / 2
    )
    assert "| code | " in text and "| average | " in text and "| 2/2 ar |" in text
    assert "hf-assisted is batch 1 only" in text
    assert "| SD / AR |" in text and "| SSD / SD |" in text and "| SD / hf-assisted |" in text
    # round efficiency from the run's own probes and acceptance, at batch 1 (the probes time one sequence)
    for row in rows_of(saved, "sd"):
        eff = round_efficiency(saved, row)
        assert (eff is None) == (row["batch"] != 1)
        if eff:
            assert eff["efficiency"] > 0 and eff["E"] == row["mean_acceptance_length"]
            assert f"| sd | 2 | {row['set']} | {eff['E']:.2f} |" in text
    assert "| SD round efficiency |" in text


def test_cuda_flags_place_the_target_on_gpus_and_the_draft_after_them(tiny_qwen2):
    opts = options.parse(
        ["--model", tiny_qwen2, "--draft", tiny_qwen2, "--device", "cuda", "--tp", "2"]
    )
    assert opts.dtype == "bfloat16" and opts.device == "cuda"
    assert "target on GPU 0, 1 (TP 2); SSD draft process on GPU 2" in opts.placement_text()
    cpu = options.parse(
        [
            "--model",
            tiny_qwen2,
            "--draft",
            tiny_qwen2,
            "--tp",
            "2",
            "--cores",
            "0,1",
            "--draft-cores",
            "2",
        ]
    )
    assert (
        cpu.dtype == "float32"
        and cpu.placement(with_draft=True) == "0;1;2"
        and cpu.placement(False) == "0;1"
    )


def test_cuda_kernel_benchmark_smoke_run_on_cpu():
    """The GPU benchmark's code path, on tiny shapes under the Triton interpreter (so it cannot rot
    between GPU loans): every kernel row and every backend / graphs row is produced."""
    pytest.importorskip("triton")
    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "benchmarks",
        "gpu",
        "bench_cuda_kernels.py",
    )
    done = subprocess.run(
        [sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows if r[0].strip() in ("decode", "verify", "tree")] == [
        "decode",
        "verify",
        "tree",
    ]
    engine = [(r[0].strip(), r[1].strip()) for r in rows if r[0].strip() in ("torch", "triton")]
    assert engine == [("torch", "off")] * 2 + [("triton", "off")] * 2 + [("triton", "on")] * 2
    assert all(float(r[3]) > 0 for r in rows if r[0].strip() in ("torch", "triton"))


def test_cpu_model_and_flags_are_in_every_machine_line(monkeypatch):
    import ssd_engine.utils.machine

    monkeypatch.setattr(ssd_engine.utils.machine, "cpu_model", lambda: "Test CPU 9000")
    monkeypatch.setattr(ssd_engine.utils.machine, "cpu_flags", lambda: ["avx2", "avx512_bf16"])
    assert machine_line().startswith(
        f"Test CPU 9000 (avx2, avx512_bf16), {os.cpu_count()} cores visible; torch "
    )
    monkeypatch.setattr(ssd_engine.utils.machine, "cpu_flags", lambda: [])
    assert machine_line().startswith("Test CPU 9000 (no AVX2 / AVX-512 / AMX), ")


def test_host_speed_is_measured_on_one_thread_and_leaves_torch_threads_alone():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        speed = host_speed.measure()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert all(math.isfinite(value) and value > 0 for value in asdict(speed).values())


def test_a_run_whose_host_changed_speed_is_marked():
    before = host_speed.HostSpeed(gemm_gflops=100.0, copy_gbps=20.0, python_msteps=40.0)
    steady = host_speed.describe(before, host_speed.HostSpeed(95.0, 21.0, 38.0))
    assert steady == (
        "host speed before / after the run: fp32 GEMM 100.0 / 95.0 GFLOP/s, copy 20.0 / 21.0 GB/s "
        "(1 thread), Python 40.0 / 38.0 M loop steps/s"
    )
    slowed = host_speed.HostSpeed(
        100.0, 0.5, 40.0
    )  # memory copies 40x slower: the figure decode depends on
    assert host_speed.drift(before, slowed) == pytest.approx(0.975)
    assert host_speed.describe(before, slowed).endswith(
        "(the host's speed moved 98% while it ran: compare this run's figures with care)"
    )
    assert host_speed.drift(slowed, before) == pytest.approx(
        39.0
    )  # a host that recovered is marked too


def test_sd_all_and_auto_get_both_core_sets_and_auto_no_k_sweep():
    opts = options.parse(
        [
            "--model",
            "t",
            "--draft",
            "d",
            "--mode",
            "sd-all,auto",
            "--cores",
            "0",
            "--draft-cores",
            "1",
            "--k",
            "2,4",
            "--batch",
            "1,2",
            "--draft-dtype",
            "int8",
        ]
    )
    assert (
        opts.draft_dtype == "int8"
        and options.parse(["--model", "t", "--mode", "ar"]).draft_dtype == "auto"
    )
    wide = ours._wide(opts)
    assert (
        wide.cores == {0, 1} and wide.threads == 2 and opts.cores == {0}
    )  # a copy: ar / sd keep core 0
    assert (
        ours._engine_options(opts, True)["cpu_cores"] == "0;1"
    )  # auto: the target's set, then the draft's
    assert (
        isolate.cells_of("sd-all", opts, 3) == 2 * 2 * 3
        and isolate.cells_of("auto", opts, 3) == 2 * 3
    )
    # sd-all shares the cores between target and draft: overlapping flags are fine for it
    assert options.parse(
        ["--model", "t", "--draft", "d", "--mode", "sd-all", "--draft-cores", "0"]
    ).modes == ["sd-all"]


class FakeLLM:
    """Stands in for ssd_engine.LLM: records how it was built, generates 6 tokens per request with
    fixed timings, and reports speculation counters consistent with K."""

    built: list = []

    def __init__(self, model, **kwargs):
        self.kwargs = kwargs
        FakeLLM.built.append(self)
        mode, k = kwargs["speculative_mode"], kwargs.get("num_speculative_tokens", 4)
        self.config = SimpleNamespace(
            model=SimpleNamespace(device="cpu"), speculative=SimpleNamespace(mode=mode, k=k)
        )
        chosen = (
            SimpleNamespace(
                mode="ssd",
                k=3,
                predicted_tok_s={"ar": 2.0, "ssd": 5.0},
                describe=lambda: "ssd K=3 (predicted ar 2.0, ssd 5.0 tok/s)",
            )
            if mode == "auto"
            else None
        )
        ran = chosen.mode if chosen else mode
        self.k = chosen.k if chosen else k
        plan = SimpleNamespace(
            choice=chosen,
            mode=ran,
            config=SimpleNamespace(speculative=SimpleNamespace(k=self.k)),
            draft_format=SimpleNamespace(name="int4"),
        )
        self.engine = SimpleNamespace(
            speculator=SimpleNamespace(runner=None, blocks=None),
            runner=None,
            spec_metrics=SimpleNamespace(reset=lambda: None),
            block_manager=None,
            plan=plan,
        )

    def generate(self, prompts, params, use_tqdm=False):
        metrics = SimpleNamespace(ttft_s=0.1, e2e_s=0.6)
        return [SimpleNamespace(token_ids=[7] * 6, metrics=metrics) for _ in prompts]

    def speculation_metrics(self):
        return {
            "rounds": 5,
            "drafted": 5 * self.k,
            "accepted": 4,
            "acceptance_rate": 0.5,
            "mean_acceptance_length": 2.0,
            "cache_hit_rate_warm": 0.75,
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def fake_engine(monkeypatch):
    import ssd_engine

    pinned = []
    FakeLLM.built = []
    monkeypatch.setattr(ssd_engine, "LLM", FakeLLM)
    monkeypatch.setattr(
        ours, "pin", lambda cores, threads, device: pinned.append((set(cores), threads))
    )
    opts = options.parse(
        [
            "--model",
            "t",
            "--draft",
            "d",
            "--cores",
            "0",
            "--draft-cores",
            "1",
            "--batch",
            "1,2",
            "--k",
            "2",
            "--reps",
            "0",
            "--draft-dtype",
            "int4",
            "--fanout",
            "3",
        ]
    )
    return opts, pinned


def test_auto_runs_once_per_batch_on_every_core_and_records_its_choice(fake_engine):
    opts, pinned = fake_engine
    result = ours.run_auto(opts, {"code": ["a", "b"]}, lambda *_: None)
    kwargs = FakeLLM.built[0].kwargs
    assert len(FakeLLM.built) == 1 and pinned == [({0, 1}, 2)]
    assert (
        kwargs["speculative_mode"] == "auto" and "num_speculative_tokens" not in kwargs
    )  # it picks K
    assert (
        kwargs["cpu_cores"] == "0;1"
        and kwargs["num_threads"] is None
        and kwargs["draft_dtype"] == "int4"
    )
    assert kwargs["ssd_fanout"] == "3"
    assert [(r["mode"], r["batch"], r["k"]) for r in result["rows"]] == [
        ("auto", 1, 3),
        ("auto", 2, 3),
    ]
    row = result["rows"][0]
    assert (row["chosen_mode"], row["chosen_k"], row["draft_format"]) == ("ssd", 3, "int4")
    assert row["predicted_tok_s"] == {"ar": 2.0, "ssd": 5.0} and row["drafted"] == 15
    assert row["ssd"]["cache_hit_rate_warm"] == 0.75  # it ran SSD: SSD's counters
    assert result["mode_choice"].startswith("ssd K=3")


def test_sd_all_is_sd_with_the_draft_in_process_on_both_core_sets(fake_engine):
    opts, pinned = fake_engine
    result = ours.run_sd_all(opts, {"code": ["a", "b"]}, lambda *_: None)
    kwargs = FakeLLM.built[0].kwargs
    assert pinned == [({0, 1}, 2)] and kwargs["num_threads"] == 2 and "cpu_cores" not in kwargs
    assert kwargs["speculative_mode"] == "sd" and kwargs["num_speculative_tokens"] == 2
    assert kwargs["draft_dtype"] == "int4"
    assert {(r["mode"], r["k"], r["draft_format"]) for r in result["rows"]} == {
        ("sd-all", 2, "int4")
    }
    assert all(r["drafted"] == 2 * r["rounds"] and "ssd" not in r for r in result["rows"])


def _fake_raw(tok_s: dict, batch=(1,)) -> dict:
    """A result with one prompt set: mode -> (K, decode tok/s, extra row fields) at every batch size."""

    def row(mode, k, value, b, extra):
        return {
            "mode": mode,
            "set": "code",
            "batch": b,
            "k": k,
            "decode_tok_s": value / b,
            "e2e_tok_s": 1.0,
            "ttft_s": 0.1,
            "tpot_s": 0.2,
            "latency_s": 1.0,
            **extra,
        }

    return {
        "date": "d",
        "machine": "m",
        "placement": "p",
        "target": "t",
        "draft": "d",
        "command": "c",
        "temperature": 0.0,
        "new_tokens": 6,
        "num_prompts": 1,
        "prompt_sets": ["code"],
        "batch": list(batch),
        "k": [4],
        "dtype": "float32",
        "draft_dtype": "int4",
        "prefix": 8,
        "reps": 0,
        "results": {
            mode: {
                "rows": [
                    row(mode, k, v, b, extra) for b in batch if mode != "hf-assisted" or b == 1
                ]
            }
            for mode, (k, v, extra) in tok_s.items()
        },
    }


def test_report_shows_draft_formats_auto_choices_and_the_goal_ratios():
    spec = {"draft_format": "int4"}
    raw = _fake_raw(
        {
            "ar": (None, 2.0, {}),
            "ar-all": (None, 3.0, {}),
            "sd": (4, 4.0, spec),
            "sd-all": (4, 5.0, spec),
            "auto": (
                3,
                4.5,
                {**spec, "chosen_mode": "sd", "chosen_k": 3, "predicted_tok_s": {"sd": 5.0}},
            ),
            "hf-assisted": (4, 2.5, {}),
        },
        batch=(1, 2),
    )
    raw["results"]["auto"]["mode_choice"] = "sd K=3"
    assert "SD at K = 4, int4 draft" in headline_lines(raw)[0]
    details = "\n".join(detail_lines(raw))
    assert (
        "| sd-all | 4 | int4 | 1 | 5.00 |" in details
        and "| auto: sd | 3 | int4 | 2 | 2.25 |" in details
    )
    assert "| ar | - | - | 1 | 2.00 |" in details
    goals = "\n".join(goal_lines(raw))
    assert "| SD / AR | speculation on the target's cores | 2.00x | 2.00x |" in goals
    assert "| auto / ar-all | auto vs AR on the same cores | 1.50x | 1.50x |" in goals
    assert (
        "| auto / best of (ar-all, sd-all) |" in goals
        and "| 0.90x (sd-all) | 0.90x (sd-all) |" in goals
    )
    assert (
        "| SD / hf-assisted | our SD vs transformers' assisted generation | 1.60x | n/a |" in goals
    )
    assert "SSD" not in goals  # no ssd run: none of its ratios
    assert (
        "auto ran sd at K = 3: sd K=3" in goals
        and "Predicted 5.00 tok/s for sd; measured 4.50 at batch 1, 2.25 at batch 2." in goals
    )
    text = render(raw)
    assert "## Goals" in text and "draft weights int4" in text
    assert goal_lines(_fake_raw({"ar": (None, 2.0, {})})) == []  # nothing to compare: no section


def test_passes_alternate_the_order_and_merge_cells_by_set_batch_and_k():
    from suite import passes

    assert passes.order(["ar", "sd", "ssd"], 0) == ["ar", "sd", "ssd"]
    assert passes.order(["ar", "sd", "ssd"], 1) == ["ssd", "sd", "ar"]

    def result(tok_s, wall, accepted, peak):
        rows = [
            {
                "set": "humaneval",
                "batch": 1,
                "k": 4,
                "decode_tok_s": tok_s,
                "tokens": 128,
                "requests": 2,
                "wall_s": wall,
                "rounds": 40,
                "drafted": 160,
                "accepted": accepted,
                "outputs": [[1, 2]],
                "ssd": {"T_p": tok_s / 10},
            },
            {
                "set": "gsm8k",
                "batch": 1,
                "k": 4,
                "decode_tok_s": 1.0,
                "tokens": 128,
                "requests": 2,
                "wall_s": 10.0,
                "rounds": 40,
                "drafted": 160,
                "accepted": 80,
                "outputs": [[3]],
            },
        ]
        return {"rows": rows, "peaks": {"engine": peak}, "costs": {"draft_step_s": 0.05}}

    # the second pass lists its cells in another order: they are matched by key, not position
    second = result(6.0, 30.0, 100, 7.5)
    second["rows"].reverse()
    merged = passes.merge([result(4.0, 20.0, 60, 8.0), second])
    cell = next(r for r in merged["rows"] if r["set"] == "humaneval")
    assert (
        cell["decode_tok_s"] == 5.0
        and cell["decode_tok_s_by_pass"] == [4.0, 6.0]
        and cell["passes"] == 2
    )
    assert cell["tokens"] == 256 and cell["wall_s"] == 50.0 and cell["e2e_tok_s"] == 256 / 50.0
    assert cell["acceptance_rate"] == 160 / 320 and cell["mean_acceptance_length"] == 1 + 160 / 80
    assert cell["ssd"]["T_p"] == 0.5 and cell["outputs"] == [[1, 2]]
    assert isinstance(cell["k"], int) and isinstance(cell["batch"], int)  # settings keep their type
    assert merged["peaks"] == {"engine": 8.0} and merged["costs"] == {"draft_step_s": 0.05}
    single = result(4.0, 20.0, 60, 8.0)
    assert passes.merge([single]) is single


def test_round_efficiency_is_measured_over_the_round_model():
    """E / (K t_draft + t_verify) with the run's own numbers: 3 tokens per round, 4 draft steps of
    50 ms and a 300 ms verification predict 6 tok/s; 4.5 measured is 0.75 of it."""
    spec = {"mean_acceptance_length": 3.0, "draft_format": "int4"}
    raw = _fake_raw({"ar": (None, 2.0, {}), "sd": (4, 4.5, spec)}, batch=(1, 2))
    raw["results"]["sd"]["costs"] = {
        "draft_step_s": 0.05,
        "target_forward_s": {"1": 0.25, "5": 0.3},
    }
    row = rows_of(raw, "sd", batch=1)[0]
    assert round_efficiency(raw, row) == pytest.approx(
        {"E": 3.0, "predicted_tok_s": 6.0, "efficiency": 0.75}
    )
    assert (
        round_efficiency(raw, rows_of(raw, "sd", batch=2)[0]) is None
    )  # no probe of two sequences
    assert "| sd | 4 | code | 3.00 | 50 | 300 | 6.00 | 4.50 | **0.75** |" in efficiency_lines(raw)
    goals = "\n".join(goal_lines(raw))
    efficiency = next(
        line for line in goals.splitlines() if line.startswith("| SD round efficiency |")
    )
    assert efficiency.endswith("| 0.75 | n/a |")
    del raw["results"]["sd"]["costs"]["draft_step_s"]
    assert efficiency_lines(raw) == [] and round_efficiency(raw, row) is None


def test_batch_heading_names_only_the_speculative_modes_that_ran():
    no_ssd = headline_lines(
        _fake_raw({"ar": (None, 2.0, {}), "sd": (4, 4.0, {"draft_format": "int4"})})
    )[0]
    assert no_ssd == "### Batch 1 (decode tok/s, prefill excluded; SD at K = 4, int4 draft)"
    assert (
        headline_lines(_fake_raw({"ar": (None, 2.0, {})}))[0]
        == "### Batch 1 (decode tok/s, prefill excluded)"
    )
    both = headline_lines(
        _fake_raw({"ar": (None, 2.0, {}), "sd": (4, 4.0, {}), "ssd": (2, 5.0, {})})
    )[0]
    assert both.endswith("prefill excluded; SD at K = 4; SSD at K = 2)") and "n/a" not in both


def _inside(artist, fig) -> bool:
    box, frame = artist.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    return frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1


@pytest.mark.parametrize("modes", [("ar", "sd", "ssd"), tuple(options.MODES)])
def test_throughput_title_and_legend_fit_the_figure_with_one_prompt_set(modes):
    pytest.importorskip("matplotlib")
    from suite import plots

    raw = _fake_raw(
        {
            m: (None if m.startswith("ar") or m == "hf-ar" else 4, 2.0 + i, {})
            for i, m in enumerate(modes)
        }
    )
    raw.update(date="2026-11-25", new_tokens=64)
    fig = plots.throughput_figure(raw)
    try:
        fig.canvas.draw()
        title = fig._suptitle or fig.axes[0].title  # a figure title, or the axes'
        assert title.get_text().startswith("Throughput per mode")
        assert _inside(title, fig) and _inside(fig.legends[0], fig)
    finally:
        plots._pyplot().close(fig)


def test_a_title_wider_than_its_figure_is_wrapped_to_fit():
    pytest.importorskip("matplotlib")
    from suite import plots

    plt = plots._pyplot()
    fig = plt.figure(figsize=(2.5, 2.0))
    try:
        text = "Throughput per mode, 2026-11-25 (T = 0.7, 256 tokens, a long set of settings)"
        title = plots.fitted_suptitle(fig, text)
        fig.tight_layout()
        fig.canvas.draw()
        assert "\n" in title.get_text() and title.get_text().replace("\n", " ") == text
        assert _inside(title, fig)
    finally:
        plt.close(fig)


def test_the_results_folder_is_announced_with_how_to_write_elsewhere(tmp_path):
    from suite.options import RESULTS_DIR

    default = bench.where_results_go(RESULTS_DIR, "")
    assert default.startswith(f"results: {os.path.join(RESULTS_DIR, 'DATE-bench.*')} ")
    assert "--out DIR" in default and "--tag TAG" in default
    assert bench.where_results_go(str(tmp_path), "x") == f"results: {tmp_path / 'DATE-bench-x.*'}"
    assert options.parse(["--model", "m", "--mode", "ar"]).out == RESULTS_DIR
