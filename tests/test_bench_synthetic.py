"""benchmarks/bench_synthetic.py: a tiny end-to-end sweep on shape configs built in a temporary
folder (config.json only, random weights, random-id prompts), its predictions' arithmetic on
hand-made numbers, and bench.py's synthetic flags."""

import json
import os

import bench_synthetic
import pytest
from suite import options, ours
from suite.synthetic_report import (
    expected_acceptance_rate,
    expected_tokens,
    predict_sd,
    predict_ssd,
    predict_ssd_own_verify,
)
from test_dummy_weights import shape_folder

from ssd_engine.saguaro.speedup import ssd_speedup
from ssd_engine.testing import Synthetic


def test_expected_tokens_and_predictions():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    assert expected_acceptance_rate(0.5, 2) == pytest.approx((0.5 + 0.25) / 2)
    # E = 1.75 tokens per round costing 2 draft steps of 1 + a verification of 3; AR steps cost 2
    assert predict_sd(0.5, 2, t_ar=2.0, t_verify=3.0, t_draft=1.0) == pytest.approx(1.75 / 5 * 2)
    ssd = {
        "verify_s_per_round": 0.5,
        "jit_s_per_round": 0.25,
        "cache_hit_rate_warm": 0.8,
        "T_p": 1.2,
    }
    assert predict_ssd(0.5, 2, t_ar=2.0, t_verify=3.0, ssd=ssd) == pytest.approx(
        ssd_speedup(0.8, 1.75, 1.75, 1.2, 0.5) * 2 / 3
    )
    assert predict_ssd(0.5, 2, 2.0, 3.0, {**ssd, "verify_s_per_round": 0.0}) is None
    # the draft beside the target slowed its verification to 0.5 s: predicted in AR steps of 2 s
    assert predict_ssd_own_verify(0.5, 2, t_ar=2.0, ssd=ssd) == pytest.approx(
        ssd_speedup(0.8, 1.75, 1.75, 1.2, 0.5) * 2 / 0.5
    )


def test_bench_flags_reach_the_engines_that_take_them(capsys):
    opts = options.parse(
        [
            "--model",
            "t",
            "--draft",
            "d",
            "--mode",
            "ar,sd,ssd",
            "--load-format",
            "dummy",
            "--synthetic-acceptance",
            "0.7",
            "--synthetic-hit",
            "0.9",
            "--budget",
            "3",
            "--batch",
            "1,2",
            "--k",
            "4",
        ]
    )
    assert ours._engine_options(opts, True)["load_format"] == "dummy"
    assert ours._draft_options(opts)["synthetic"] == Synthetic(acceptance=0.7)
    assert ours._draft_options(opts, lookups=True)["synthetic"] == Synthetic(
        acceptance=0.7, hit=0.9
    )
    assert ours._ssd_options(opts) == {"ssd_budget": 3}
    threaded = options.parse(
        ["--model", "t", "--draft", "d", "--mode", "ssd", "--draft-host", "thread"]
    )
    assert ours._ssd_options(threaded) == {"ssd_draft_host": "thread"}
    assert ours.probe_sizes(opts) == [
        1,
        2,
        4,
        5,
        8,
        10,
    ]  # every batch's decode step and verification
    for argv, message in (
        (["--synthetic-acceptance", "1.5"], "--synthetic-acceptance must be in [0, 1], got 1.5"),
        (["--mode", "hf-ar", "--load-format", "dummy"], "hf-ar runs transformers on the real"),
    ):
        with pytest.raises(SystemExit):
            options.parse(["--model", "t", "--draft", "d"] + argv)
        assert message in capsys.readouterr().err


def test_a_tiny_sweep_writes_every_cell_with_its_prediction(tmp_path):
    target, draft = shape_folder(tmp_path / "t"), shape_folder(tmp_path / "d", num_hidden_layers=1)
    out = tmp_path / "results"
    sweep = bench_synthetic.main(
        [
            "--target",
            target,
            "--draft",
            draft,
            "--alpha",
            "0.6",
            "--k",
            "2",
            "--budget",
            "2",
            "--hit",
            "1",
            "--batch",
            "1",
            "--draft-dtype",
            "fp32",
            "--prompt-len",
            "8",
            "--num-prompts",
            "1",
            "--new-tokens",
            "12",
            "--prefix",
            "16",
            "--reps",
            "1",
            "--out",
            str(out),
            "--tag",
            "t",
        ]
    )
    stamp = sweep["date"]
    assert sorted(os.listdir(out)) == [
        f"{stamp}-synthetic-t{ext}" for ext in (".json", ".md", ".png")
    ]
    cells = sweep["cells"]
    assert [(c["mode"], c["alpha"], c["k"], c["batch"]) for c in cells] == [
        ("sd", 0.6, 2, 1),
        ("ssd", 0.6, 2, 1),
    ]
    for c in cells:
        assert c["measured"] > 0 and c["predicted"] > 0 and c["ratio"] > 0
        assert c["expected_acceptance"] == pytest.approx(expected_acceptance_rate(0.6, 2))
    ssd = cells[1]
    assert (
        ssd["hit_rate"] == 1.0 and ssd["budget"] == 2 and ssd["T_p"] > 0
    )  # p = 1: every warm lookup hits
    assert (
        ssd["predicted_own_verify"] > 0 and cells[0]["predicted_own_verify"] is None
    )  # SSD's own verify time
    saved = json.loads((out / f"{stamp}-synthetic-t.json").read_text())
    assert (
        saved["cpu"]["cpu_model"]
        and saved["target"] == "t"
        and saved["ar"]["costs"]["target_forward_s"]
    )
    assert (
        set(saved["host_speed"]) == {"before", "after"}
        and "; host speed before / after" in saved["machine"]
    )
    text = (out / f"{stamp}-synthetic-t.md").read_text()
    assert "outputs are not the target's" in text and "| ssd | 0.6 | 2 | 1 | 2 | 1.00 |" in text
