"""Bad input is refused up front with a one-line ValueError (API) or `error:` + exit 2 (CLI),
and a refused request never disturbs the requests already in flight."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from ssd_engine import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 64


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message, f"not a one-line message: {message!r}"
    return message


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    # one intra-op thread: on a small shared machine two threads can make each step ~10x slower
    return LLM(
        tiny_qwen2,
        max_model_len=MAX_LEN,
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=4,
        num_threads=1,
    )


@pytest.fixture(scope="module")
def unloadable(tiny_qwen2, tmp_path_factory):
    """A folder that passes every check that needs no weights and fails loudly (a SafetensorError
    and its traceback, not a one-line error) the moment anything loads it: a run that reports
    something else never loaded a model, nor started a draft process that would load it."""
    path = tmp_path_factory.mktemp("cli") / "unloadable"
    shutil.copytree(tiny_qwen2, path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    return str(path)


# ---- CLI runs: started together (each subprocess pays ~3 s of imports) ------------------------------
@pytest.fixture(scope="module")
def cli_runs(tiny_qwen2, unloadable, tmp_path_factory):
    """Real subprocesses for the cases where the process boundary matters (exit status, no
    traceback); the other CLI cases call ssd_engine.generate.main in-process (same code path)."""
    missing = str(tmp_path_factory.mktemp("cli") / "no_such_model")
    cases = {
        "unknown_flag": ["--model", tiny_qwen2, "--max-model-length", "64"],
        "missing_model": ["--model", missing],
        "empty_prompt": [
            "--model",
            unloadable,
            "--draft-model",
            unloadable,
            "--mode",
            "ssd",
            "--prompt",
            "",
        ],
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "ssd_engine.generate", "--no-progress", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in cases.items()
    }
    results = {}

    def result(name):
        if name not in results:
            out, err = procs[name].communicate(timeout=120)
            results[name] = (procs[name].returncode, out, err)
        return results[name]

    result.missing_dir = missing
    yield result
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_cli_in_process(argv, capsys):
    from ssd_engine.generate import main

    with pytest.raises(SystemExit) as info:
        main(["--no-progress", *argv])
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


def assert_cli_error(run, *needles):
    rc, out, err = run
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---- model folder problems -----------------------------------------------------------------------
def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path / "nope"))
    message = one_line_error(info)
    assert "not found" in message and "nope" in message


def test_directory_without_config(tmp_path, tiny_qwen2):
    shutil.copy(os.path.join(tiny_qwen2, "model.safetensors"), tmp_path)
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path))
    assert "config.json" in one_line_error(info)


def test_directory_without_safetensors(tmp_path, tiny_qwen2):
    shutil.copy(os.path.join(tiny_qwen2, "config.json"), tmp_path)
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path))
    assert "safetensors" in one_line_error(info)


def test_checkpoint_missing_one_shard_of_a_fused_projection(tmp_path, tiny_qwen2):
    """q/k/v load into one fused tensor: a checkpoint lacking k_proj must not pass as complete."""
    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(tiny_qwen2, tmp_path / "model")
    weights = load_file(str(copy / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(copy / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        LLM(str(copy))
    assert "lacks weights" in one_line_error(
        info
    ) and "layers.1.self_attn.qkv_proj.weight" in one_line_error(info)


def test_unsupported_architecture(tmp_path, tiny_qwen2):
    copy = shutil.copytree(tiny_qwen2, tmp_path / "model")
    config_path = copy / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        LLM(str(copy))
    message = one_line_error(info)
    assert "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message


def test_real_gpt2_config_is_refused_as_unsupported(tmp_path, tiny_qwen2):
    """A genuine GPT-2 config (model_type gpt2: no num_key_value_heads) must also get the
    ValueError, not an AttributeError from sizing the KV cache."""
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_qwen2, name), tmp_path)
    config = dict(
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        vocab_size=320,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path))
    message = one_line_error(info)
    assert "GPT2LMHeadModel" in message and "Qwen2ForCausalLM" in message


def test_unknown_option_names_closest(tiny_qwen2):
    with pytest.raises(ValueError) as info:
        LLM(tiny_qwen2, max_model_length=64)
    message = one_line_error(info)
    assert "max_model_length" in message and "'max_model_len'" in message


def test_max_model_len_beyond_checkpoint(tiny_qwen2):
    with pytest.raises(ValueError) as info:
        LLM(tiny_qwen2, max_model_len=100_000)
    assert "max_model_len" in one_line_error(info) and "512" in str(info.value)


# ---- request problems -----------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError) as info:
        llm.generate("x" * (MAX_LEN + 1), use_tqdm=False)
    message = one_line_error(info)
    assert "max_model_len" in message and str(MAX_LEN + 1) in message


def test_prompt_plus_max_tokens_beyond_max_model_len(llm):
    with pytest.raises(ValueError) as info:
        llm.generate("x" * 60, SamplingParams(max_tokens=5), use_tqdm=False)
    message = one_line_error(info)
    assert "max_tokens" in message and "max_model_len" in message
    # exactly at the limit is fine
    out = llm.generate(
        "x" * 60, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 4


def test_request_larger_than_whole_kv_cache(tiny_qwen2):
    small = LLM(
        tiny_qwen2, max_model_len=MAX_LEN, block_size=4, num_kv_blocks=4, num_threads=1
    )  # 16 token slots
    with pytest.raises(ValueError) as info:
        small.generate("x" * 10, SamplingParams(max_tokens=10), use_tqdm=False)
    message = one_line_error(info)
    assert "KV" in message and "num_kv_blocks" in message
    assert not small.engine.has_unfinished()
    out = small.generate(
        "x" * 10, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("prompt", ["", [[]]], ids=["empty_string", "empty_token_list"])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError) as info:
        llm.generate(prompt, use_tqdm=False)
    assert "empty" in one_line_error(info)


def test_empty_token_list_via_engine_and_empty_batch(llm):
    with pytest.raises(ValueError) as info:
        llm.engine.add_request([])
    assert "empty" in one_line_error(info)
    with pytest.raises(ValueError) as info:
        llm.generate([], use_tqdm=False)
    assert "prompt" in one_line_error(info)


@pytest.mark.parametrize("bad", [10**6, -1, 320])
def test_token_id_outside_vocabulary(llm, bad):
    with pytest.raises(ValueError) as info:
        llm.generate([5, bad, 6], use_tqdm=False)
    message = one_line_error(info)
    assert str(bad) in message and "vocab" in message
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_sampling_params(kwargs, needle):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert needle in one_line_error(info)


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_and_minus_one_mean_disabled(llm, top_k):
    out = llm.generate(
        "hello",
        SamplingParams(temperature=1.0, top_k=top_k, seed=1, max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.token_ids) == 3


def test_bad_prompt_in_batch_names_its_index_and_queues_nothing(llm):
    with pytest.raises(ValueError) as info:
        llm.generate(["fine", "x" * (MAX_LEN + 5)], use_tqdm=False)
    assert one_line_error(info).startswith("prompt 1:")
    assert not llm.engine.has_unfinished()


def test_bad_request_never_takes_other_requests_down(llm):
    greedy = dict(temperature=0, ignore_eos=True)
    expected = llm.generate(
        ["abc", "hello world"],
        [SamplingParams(max_tokens=5, **greedy), SamplingParams(max_tokens=9, **greedy)],
        use_tqdm=False,
    )
    engine = llm.engine
    a = engine.add_request("abc", SamplingParams(max_tokens=5, **greedy))
    b = engine.add_request("hello world", SamplingParams(max_tokens=9, **greedy))
    engine.step()
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    for bad_prompt, bad_params in [
        ("x" * (MAX_LEN + 1), None),
        ("", None),
        ([10**6], None),
        ("ok", SamplingParams(max_tokens=MAX_LEN)),
    ]:
        with pytest.raises(ValueError):
            engine.add_request(bad_prompt, bad_params)
    assert set(engine.scheduler.running) | set(engine.scheduler.waiting) == {a, b}
    for _ in range(20):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert a.is_finished and b.is_finished
    assert a.finish_reason == b.finish_reason == "length"
    assert (a.num_output_tokens, b.num_output_tokens) == (5, 9)
    assert (
        a.output_token_ids == expected[0].token_ids and b.output_token_ids == expected[1].token_ids
    )


# ---- CLI -----------------------------------------------------------------------------------------
def test_cli_unknown_flag(cli_runs):
    line = assert_cli_error(cli_runs("unknown_flag"), "--max-model-length")
    assert "'--max-model-len'" in line


def test_cli_missing_model_dir(cli_runs):
    assert_cli_error(cli_runs("missing_model"), cli_runs.missing_dir)


def test_cli_empty_prompt_is_refused_before_loading(cli_runs):
    assert_cli_error(cli_runs("empty_prompt"), "prompt is empty")


def test_cli_negative_temperature(unloadable, capsys):
    assert_cli_error(
        run_cli_in_process(["--model", unloadable, "--temperature", "-1"], capsys), "temperature"
    )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--prompt", "a", "--prompt", ""], "prompt 1 is empty"),
        (["--stream", "--prompt", "a", "--prompt", "b"], "--stream takes one prompt"),
        (["--top-p", "0"], "top_p"),
        (["--k", "0"], "num_speculative_tokens"),
        (["--dtype", "float64"], "dtype"),
    ],
    ids=["empty_second_prompt", "stream_batch", "top_p", "k", "dtype"],
)
def test_cli_refuses_before_loading(unloadable, capsys, argv, needle):
    assert_cli_error(run_cli_in_process(["--model", unloadable, *argv], capsys), needle)


def test_missing_draft_is_refused_before_the_target_loads(unloadable, tmp_path, capsys):
    missing = str(tmp_path / "no_such_draft")
    assert_cli_error(
        run_cli_in_process(["--model", unloadable, "--draft-model", missing], capsys), missing
    )
    with pytest.raises(ValueError) as info:
        LLM(unloadable, draft_model=missing, speculative_mode="sd")
    assert missing in one_line_error(info)


def test_cli_prompt_too_long(tiny_qwen2, capsys):
    run = run_cli_in_process(
        ["--model", tiny_qwen2, "--max-model-len", "16", "--prompt", "x" * 40], capsys
    )
    assert_cli_error(run, "40", "max_model_len=16")


def test_a_closed_llm_answers_with_its_last_metrics_and_refuses_work_in_one_line(tiny_qwen2):
    """The README's pattern: generate inside `with`, read the metrics after it."""
    with LLM(
        tiny_qwen2,
        draft_model=tiny_qwen2,
        speculative_mode="sd",
        num_threads=1,
        max_model_len=MAX_LEN,
    ) as closed:
        closed.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        during = closed.speculation_metrics()
    assert during["rounds"] > 0 and closed.speculation_metrics() == during
    closed.close()  # twice is fine
    with pytest.raises(RuntimeError) as excinfo:
        closed.generate([[5, 6, 7]])
    assert "closed" in one_line_error(excinfo)
