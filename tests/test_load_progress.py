"""Loading shows progress (issue 19, item 6): a bar per model on stderr, the SSD draft's included;
the CLI's --no-progress (SSD_ENGINE_PROGRESS=0) hides them."""

import os

import pytest
from runners import tiny_runner

from ssd_engine.utils.progress import PROGRESS_ENV


@pytest.fixture(autouse=True)
def progress_on(monkeypatch):
    # an in-process CLI run with --no-progress sets it; setenv also restores it after each test
    monkeypatch.setenv(PROGRESS_ENV, "1")


def test_loading_a_model_draws_a_bar_named_after_it(tiny_qwen2, capfd):
    tiny_runner(tiny_qwen2, num_kv_blocks=8, block_size=16, max_position=64, weight_layout="packed")
    err = capfd.readouterr().err
    name = os.path.basename(os.path.normpath(tiny_qwen2))
    assert f"loading {name}" in err and "100%" in err


def test_ssd_draft_process_shows_its_own_bar(tiny_qwen2, tiny_model_dir, capfd):
    from ssd_engine import LLM

    draft = tiny_model_dir("qwen2", seed=1)
    with LLM(tiny_qwen2, draft_model=draft, speculative_mode="ssd", max_model_len=64):
        pass
    err = capfd.readouterr().err
    for path in (tiny_qwen2, draft):
        assert f"loading {os.path.basename(os.path.normpath(path))}" in err


def test_no_progress_hides_loading_bars(tiny_qwen2, tiny_model_dir, capfd, monkeypatch):
    from ssd_engine.generate import main

    draft = tiny_model_dir("qwen2", seed=1)
    main(
        [
            "--no-progress",
            "--model",
            tiny_qwen2,
            "--draft-model",
            draft,
            "--max-tokens",
            "2",
            "--prompt",
            "ab",
        ]
    )
    assert "loading" not in capfd.readouterr().err
