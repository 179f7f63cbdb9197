"""The GPU-cost proxies count what they say (tests/instrumentation/: the counters, proxy_counts.py and gpu_proxies.py's report): the op counter counts a known
function op by op, kind by kind and line by line, and a tiny model's ops per decoder layer are
stable, > 0, and exactly 3 more per Linear when row padding is on; the sync counter sees host
reads of would-be device tensors and nothing else; one engine step's ops are finite measured
numbers for AR, SD and SSD, and each step reads the device exactly once (the emitted tokens), greedy
and at T = 0.7, for AR, SD and the SSD coordinator."""

from collections import Counter

import pytest
import torch
from instrumentation import gpu_proxies, proxy_counts
from instrumentation.op_count import OpCounter, without_row_padding
from instrumentation.step_count import count_ops, count_syncs, op_summary, sync_summary
from instrumentation.sync_count import SyncCounter

from ssd_engine import LLM, SamplingParams

HERE = "tests/test_gpu_proxies.py"


def _known(x):
    y = x * 2  # mul: a new tensor
    z = y.view(-1)  # view: aliases y
    w = z + 1  # add
    w.add_(1)  # add_: in place, writes memory
    same = w.to(torch.float32)  # to: changes nothing, returns w
    wider = w.to(torch.float64)  # to: converts
    return same.sum() + wider.sum()  # sum, sum, add


def test_op_counter_counts_a_known_function_exactly():
    x = torch.ones(4, 3)
    with torch.inference_mode(), OpCounter() as ops:
        _known(x)
    assert ops.by("op") == Counter(
        {
            ("mul", "compute"): 1,
            ("view", "view"): 1,
            ("add", "compute"): 2,
            ("add_", "compute"): 1,
            ("to", "view"): 1,
            ("to", "compute"): 1,
            ("sum", "compute"): 2,
        }
    )
    assert ops.total() == 9 and ops.total(kind="compute") == 7 and ops.scopes() == ["step"]
    first = _known.__code__.co_firstlineno
    sites = ops.by("site")
    assert sites[(f"{HERE}:{first + 1} _known", "compute")] == 1  # the mul, on its own line
    assert sites[(f"{HERE}:{first + 2} _known", "view")] == 1
    assert sites[(f"{HERE}:{first + 7} _known", "compute")] == 3
    assert all(site.startswith(f"{HERE}:") for site, _ in sites)


def test_op_counter_scopes_by_module_and_by_name():
    inner = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(torch.nn.ReLU(), inner)
    ops, x = OpCounter(), torch.ones(2, 3)
    with torch.inference_mode(), ops.scoped([inner], "inner"), ops:
        out = model(x)
        with ops.scope("after"):
            out.sum()
    assert ops.calls["inner"] == 1 and ops.total("inner") >= 1 and ops.total("after") == 1
    assert ops.total("step") == 1  # the relu, outside the scoped module
    assert inner._forward_hooks == {} and inner._forward_pre_hooks == {}  # hooks removed


def test_a_tiny_models_ops_per_layer_are_stable_and_row_padding_adds_three_per_linear(tiny_qwen2):
    from ssd_engine.layers import row_padding

    with without_row_padding():
        first, again = (
            proxy_counts.layer_counts(tiny_qwen2, None),
            proxy_counts.layer_counts(tiny_qwen2, None),
        )
        int4 = proxy_counts.layer_counts(tiny_qwen2, "int4")
        row_padding._padded[torch.float32] = {1: 4}  # pad one-row fp32 matmuls to four rows
        padded = proxy_counts.layer_counts(tiny_qwen2, None)
    assert first == again
    assert 0 < first["per_layer_compute"] < first["per_layer"] and first["torch_attention"] > 0
    assert first["sampling_greedy"] >= 1 and first["sampling_t07"] > first["sampling_greedy"]
    assert first["first_layer_extra"] > 0  # the torch backend expands the step's metadata once
    assert first["step_total"] == (
        2 * first["per_layer"]
        + first["first_layer_extra"]
        + first["outside_layers"]
        + first["sampling_greedy"]
    )
    linears = 4  # qkv, o, gate_up, down: each padded with new_zeros + cat, then sliced back
    assert padded["per_layer"] == first["per_layer"] + 3 * linears
    assert int4["by_op"].get("_weight_int4pack_mm_for_cpu (compute)") == linears
    assert "_linear_pointwise (compute)" not in int4["by_op"]
    assert sum(s["calls"] for s in first["by_site"]) == first["per_layer"]


def test_sync_counter_counts_host_reads_of_would_be_device_tensors_only():
    device = torch.device(
        "cpu"
    )  # what the engine passes: a device object stands for the accelerator
    before = torch.tensor([0, 1])
    with torch.inference_mode(), SyncCounter() as syncs:
        on_device = torch.tensor([1, 2, 3], device=device)
        host = torch.tensor([1, 2, 3])
        host.tolist(), host[0].item(), bool(host[1] > 0)  # host reads: no syncs
        derived = on_device * 2  # computed from a device tensor: on the device
        derived.tolist()  # tolist
        derived[0].item()  # item
        bool(derived[1] > 0)  # bool
        derived[derived > 2]  # mask_index: a value-dependent shape
        torch.repeat_interleave(derived, derived)  # repeat_interleave: so is this one's
        torch.repeat_interleave(derived, derived, output_size=12)  # unless the caller knows it
        moved = host.to(device)  # h2d: from pageable memory; `host` stays on the host
        host.tolist()
        moved.cpu()  # cpu
        on_device.to("cpu").tolist()  # cpu; the copy is a host tensor
        host.to(device, non_blocking=True)  # pinned and non-blocking (host_upload.py): no wait
        before.to(device), derived[before]  # made before counting: could live anywhere
        derived[[0, 1]]  # h2d: a list index crosses blocking
        derived[host - 1]  # h2d: so does a host tensor's
        derived[moved - 1]  # on the device already
        derived[0:2] = host[:2]  # h2d: a host tensor written in
        derived.copy_(host * 3)  # h2d: computed from host values only
        derived[0] = 5  # a Python scalar: an argument, no copy
    kinds = Counter()
    for (kind, site), n in syncs.counts.items():
        kinds[kind] += n
        assert site.startswith(f"{HERE}:")
    assert kinds == Counter(
        {
            "tolist": 1,
            "item": 1,
            "bool": 1,
            "mask_index": 1,
            "repeat_interleave": 1,
            "cpu": 2,
            "h2d": 6,
        }
    )  # torch.tensor(..., device=device) is one too


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return proxy_counts.tiny_pair(str(tmp_path_factory.mktemp("proxy_pair")))


def _steps(llm, temperature: float, n: int = 2) -> tuple[list[dict], list[dict]]:
    engine = llm.engine
    engine.add_request(
        list(range(3, 12)),
        SamplingParams(temperature=temperature, seed=0, max_tokens=64, ignore_eos=True),
    )
    engine.step(), engine.step()  # the prefill and a first round
    return (
        [op_summary(count_ops(engine)) for _ in range(n)],
        [sync_summary(count_syncs(engine)) for _ in range(n)],
    )


# the one read of a round: the sampled tokens (AR), the verification's result (SD, SSD)
ONE_READ = {
    "ar": "tolist @ ssd_engine/sampling/verifier.py",
    "sd": "tolist @ ssd_engine/sampling/rejection.py",
    "ssd": "tolist @ ssd_engine/sampling/rejection.py",
}


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_engine_steps_are_measured_and_read_the_device_once(pair, mode):
    target, draft = pair
    options = (
        {}
        if mode == "ar"
        else dict(draft_model=draft, num_speculative_tokens=3, draft_dtype="fp32")
    )
    with LLM(target, speculative_mode=mode, num_threads=1, max_model_len=128, **options) as llm:
        ops, greedy = _steps(llm, temperature=0.0)
        # a request at T = 0.7 joins the greedy one: the counted rounds then batch a sampled and a
        # greedy sequence (the T > 0 paths: probability rows, seeded draws, the stochastic verifier)
        _, mixed = _steps(llm, temperature=0.7)
    assert ops[0] == ops[1] and greedy[0] == greedy[1]  # steady decoding: every round alike
    assert ops[0]["target_layer_calls"] == 2  # the tiny target's two layers, once
    # an SD round's draft forwards: the catch-up and K - 1 steps (one layer each); SSD's draft is another process
    assert ops[0]["draft_layer_calls"] == {"ar": 0, "sd": 3, "ssd": 0}[mode]
    assert 0 < ops[0]["layer_ops"] < ops[0]["ops"]
    # an overhead-free round: the emitted tokens reach the host, once; nothing else is read back
    for syncs in greedy + mixed:
        assert syncs["syncs"] == 1, syncs["syncs_by_site"]
        [(site, n)] = syncs["syncs_by_site"].items()
        assert site.startswith(ONE_READ[mode]) and n == 1


def test_sd_under_tensor_parallelism_reads_the_device_once(pair):
    """Rank 0 sends its workers the drafts' places, and the drafts by broadcast: not read on the host."""
    target, draft = pair
    with LLM(
        target,
        speculative_mode="sd",
        draft_model=draft,
        num_speculative_tokens=3,
        draft_dtype="fp32",
        tensor_parallel_size=2,
        max_model_len=128,
    ) as llm:
        _, greedy = _steps(llm, temperature=0.0)
        _, mixed = _steps(llm, temperature=0.7)
    for syncs in greedy + mixed:
        [(site, n)] = syncs["syncs_by_site"].items()
        assert site.startswith(ONE_READ["sd"]) and n == 1


def test_the_gpu_path_runs_a_layer_in_ten_kernels(tiny_qwen2):
    """Triton attention (split-KV as an H100 splits a batch-1 decode) and the fused layer kernels,
    each launch one kernel: issue 22's <= 10 per decoder layer. The torch path's count is the control."""
    with without_row_padding():
        gpu = proxy_counts.layer_counts(tiny_qwen2, None, gpu_path=True)
        eager = proxy_counts.layer_counts(tiny_qwen2, None)
    kernels = {op for op in gpu["by_op"] if op.startswith("triton:")}
    assert kernels == {
        f"triton:{name} (compute)"
        for name in (
            "add_rms_norm",
            "rope_cache_write",
            "paged_attention",
            "merge_splits",
            "silu_mul",
        )
    }
    assert gpu["by_op"]["triton:add_rms_norm (compute)"] == 2 and gpu["torch_attention"] == 0
    assert gpu["per_layer_compute"] <= gpu_proxies.GOAL_OPS_PER_LAYER < eager["per_layer_compute"]


def test_piecewise_graphs_leave_attention_and_its_input_to_the_host(tiny_qwen2):
    """A prefill chunk on the GPU path: eager, a layer is 9 launches (4 matmuls, 2 norms, RoPE + K/V
    write, attention, SiLU-mul); with piecewise graphs 4 (RoPE + K/V write, attention, the copy of its
    output into the next piece's input, that piece's replay)."""
    with without_row_padding():
        row = proxy_counts.prefill_launches(tiny_qwen2)
    assert (row["eager_launches_per_layer"], row["piecewise_launches_per_layer"]) == (9, 4)
    assert row["piecewise_launches"] < row["eager_launches"]
    assert (
        f"| target | {row['layers']} | 9 / {row['eager_launches']} | **4 / {row['piecewise_launches']}** |"
        in "\n".join(gpu_proxies.prefill_lines([{"model": "target", **row}]))
    )


def test_gpu_proxies_writes_its_tables(tiny_qwen2, pair, tmp_path):
    # the GPU path's rows and the prefill section: the two tests above (interpreted, slow to repeat)
    raw = gpu_proxies.main(
        [
            "--target",
            tiny_qwen2,
            "--draft",
            pair[1],
            "--formats",
            "int8",
            "--modes",
            "ar",
            "--steps",
            "1",
            "--out",
            str(tmp_path),
            "--no-gpu-path",
        ]
    )
    assert [(r["model"], r["format"]) for r in raw["layers"]] == [
        ("target", "fp32"),
        ("draft", "int8"),
    ]
    assert [(r["mode"], r["temperature"]) for r in raw["engine"]] == [("ar", 0.0), ("ar", 0.7)]
    text = (tmp_path / f"{raw['date']}-ops.md").read_text()
    assert text == gpu_proxies.render(raw) and raw["cpu"]["cpu_model"] in text
    assert f"| target | fp32 | 2 | **{raw['layers'][0]['per_layer']}** |" in text
    assert raw["prefill"] == []
    assert (tmp_path / f"{raw['date']}-ops.json").is_file()


def test_bench_host_overhead_takes_the_replays_out(tmp_path):
    """Host time per step on the emulated GPU path: the replays (the forward itself, here run by
    Triton's interpreter: tens of ms) are out of it, the LM head's CPU matmul is reported apart."""
    from gpu import bench_host_overhead

    rows = bench_host_overhead.main(["--modes", "ar", "--steps", "2", "--out", str(tmp_path)])
    assert [(r["mode"], r["temperature"]) for r in rows] == [("ar", 0.0), ("ar", 0.7)]
    for r in rows:
        assert r["forwards_per_step"] == 1
        assert 0 < r["host_us_per_step_without_head"] < r["host_us_per_step"] < 20_000
        assert 0 < r["host_us_per_step_replays_skipped"] < 20_000
        # the device idle between the round's read and the next launch: measured apart from the step's
        # host time it is part of, so only its presence is asserted (two timings compare on noise)
        assert 0 < r["read_to_launch_us"] < 20_000
        # greedy: the columns' copy, block tables, the logit row, LM head, argmax (a GPU adds the upload)
        assert 5 <= r["launches_outside_replays"] < 30
    assert "replays skipped" in next(tmp_path.glob("*-host-overhead.md")).read_text()
