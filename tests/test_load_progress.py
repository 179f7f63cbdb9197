"""Loading shows progress (issue 19, item 6): a bar per model on stderr, the SSD draft's included."""
import os

import torch

from ssd_engine.engine.model_runner import ModelRunner
from ssd_engine.models.loader import load_config


def test_loading_a_model_draws_a_bar_named_after_it(tiny_qwen2, capfd):
    ModelRunner(tiny_qwen2, load_config(tiny_qwen2), num_kv_blocks=8, block_size=16, max_position=64,
                dtype=torch.float32, device=torch.device("cpu"), weight_layout="packed")
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
