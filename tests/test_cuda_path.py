"""The same engine on CUDA (runs only where a GPU is present; CI has none).

The torch reference attention, paged KV cache, sampler and verifier are device-agnostic; on CUDA
the engine must still match transformers (on the same GPU, fp32) token for token.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ssd_engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [list(range(5, 12)), list(range(40, 53)), [7, 8, 9]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_greedy_matches_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    expected = [
        oracle.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(path, device="cuda", dtype="float32") as llm:
        runner = (
            llm.engine.runner.local
        )  # auto: the Triton layer kernels on CUDA (compiled: inductor's instead)
        assert (runner.layer_ops is None) == (runner.compiled is not None)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected
    # torch's ops, graphed
    with LLM(path, device="cuda", dtype="float32", fused_kernels="off") as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected
    draft = tiny_model_dir(arch, seed=1, num_hidden_layers=1)
    with LLM(
        path,
        device="cuda",
        dtype="float32",
        draft_model=draft,
        speculative_mode="sd",
        num_speculative_tokens=3,
    ) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected


def test_cuda_seeded_sampling_reproducible(tiny_qwen2):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    with LLM(tiny_qwen2, device="cuda", dtype="float32") as llm:
        alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].token_ids
        batch = llm.generate(
            PROMPTS,
            [params, SamplingParams(max_tokens=16), SamplingParams(max_tokens=16)],
            use_tqdm=False,
        )
    assert batch[0].token_ids == alone


@pytest.mark.parametrize("fanout,host", [("1", "process"), ("0", "process"), ("1", "thread")])
def test_cuda_ssd_matches_transformers(tiny_model_dir, fanout, host):
    """SSD on CUDA: the draft process on the next GPU (or sharing the only one), or a thread of the
    engine on its own CUDA stream; greedy == transformers."""
    path = tiny_model_dir("qwen2", vocab_size=259)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    expected = [
        oracle.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # draft_dtype fp32: the draft is the target, bit for bit, so a fan-out of 1 always hits
    with LLM(
        path,
        device="cuda",
        dtype="float32",
        draft_model=path,
        num_speculative_tokens=3,
        speculative_mode="ssd",
        ssd_fanout=fanout,
        draft_dtype="fp32",
        ssd_draft_host=host,
    ) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected
        metrics = llm.speculation_metrics()
    assert metrics["draft_failures"] == []
    assert (
        (metrics["cache_hit_rate_warm"] == 1.0)
        if fanout == "1"
        else metrics["cache_hit_rate"] == 0.0
    )


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_steady_cuda_round_waits_for_the_device_once(tiny_model_dir, mode, temperature):
    """torch's sync debug mode on the real GPU: a round's host waits for the device once, to read the
    emitted tokens. What tests/instrumentation/sync_count.py counts on CPU (host reads, and copies from pageable
    memory to the device), checked where it matters; SSD counts the coordinator (its draft is a
    process)."""
    import warnings

    path = tiny_model_dir("qwen2", vocab_size=259)
    options = (
        {} if mode == "ar" else dict(draft_model=path, num_speculative_tokens=3, draft_dtype="fp32")
    )
    if mode == "ssd":
        options.update(ssd_draft_host="process")
    with LLM(path, device="cuda", dtype="float32", speculative_mode=mode, **options) as llm:
        engine = llm.engine
        engine.add_request(
            list(range(5, 14)),
            SamplingParams(temperature=temperature, seed=0, max_tokens=64, ignore_eos=True),
        )
        for _ in range(3):  # the prefill and first rounds: graphs captured, the SSD cache warm
            engine.step()
        waits = []
        for _ in range(3):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            waits.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))
    assert waits == [1, 1, 1]


def test_cuda_auto_times_the_gpu_and_chooses_from_what_it_measured(
    tiny_model_dir, tmp_path, monkeypatch
):
    """auto on one GPU: the forwards are timed there, graphed (planning/gpu_costs.py), AR and SD
    predicted from those costs (SSD's draft would share the one GPU: no candidate), and the chosen
    mode's greedy output is still transformers'."""
    monkeypatch.setenv("SSD_ENGINE_CACHE", str(tmp_path))
    path = tiny_model_dir("qwen2", vocab_size=259)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    expected = [
        oracle.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    draft = tiny_model_dir("qwen2", seed=1, num_hidden_layers=1, vocab_size=259)
    with LLM(
        path, device="cuda", dtype="float32", draft_model=draft, cuda_graph_max_batch=4
    ) as llm:
        choice, ran = llm.engine.plan.choice, llm.engine.plan.mode
        outputs = [
            o.token_ids
            for o in llm.generate(
                PROMPTS,
                SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                use_tqdm=False,
            )
        ]
    print(choice.describe())
    assert (
        choice.how.startswith("costs measured on 1 GPU(s)") and "SSD not a candidate" in choice.how
    )
    assert set(choice.predicted_tok_s) == {"ar", "sd"} and all(
        v > 0 for v in choice.predicted_tok_s.values()
    )
    assert ran == choice.mode in ("ar", "sd") and outputs == expected
    cached = list((tmp_path / "calibrations").glob("mode-costs-*.json"))
    assert len(cached) == 1  # the next start reads it
