"""benchmarks/profile_cpu_step.py on a tiny pair: both tables, their ops sorted by time."""

import re

import profile_cpu_step


def test_the_profile_has_an_ar_and_an_sd_table_sorted_by_time(tiny_model_dir):
    report = profile_cpu_step.main(
        [
            "--model",
            tiny_model_dir("qwen2"),
            "--draft",
            tiny_model_dir("qwen2", seed=1),
            "--threads",
            "1",
            "--steps",
            "2",
            "--k",
            "2",
        ]
    )
    assert "### AR step" in report and "### SD round, K = 2" in report
    for table in report.split("### ")[1:]:
        times = [float(ms) for ms in re.findall(r"^\| `[^`]+` \| \d+ \| ([\d.]+) \|", table, re.M)]
        assert len(times) >= 5 and times == sorted(times, reverse=True)
