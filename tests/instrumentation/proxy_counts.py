"""The GPU-cost proxies' counts (tests/instrumentation/gpu_proxies.py writes them up; the tests in
tests/test_gpu_proxies.py check them on tiny models).

1. Ops per decoder layer in a one-token decode step (op_count.py): every aten op the dispatcher routes
   inside one layer's forward, by name and call site, at the real shapes (the pair's configs, two
   layers, dummy weights, as planning/forward_timing.py builds them); plus the rest of the step
   (inputs, LM head) and the sampling after it. On a GPU each compute op is a kernel launch. The GPU
   path (Triton attention and the fused layer kernels, kernels/fused_layer_ops.py) runs under
   Triton's interpreter: each Triton launch one kernel, split-KV attention as an H100 runs a batch-1
   decode.
2. Host launches of a prefill chunk on the GPU path, eager and with piecewise graphs
   (runtime/piecewise_graphs.py), at the real shapes.
3. Ops and device-to-host syncs per engine step (step_count.py): an AR step, an SD round, an SSD
   round (the coordinator's side), greedy and sampled, on a tiny pair (syncs do not depend on the
   model's size).
"""

import contextlib
import os

TEMPERATURES = (0.0, 0.7)
PREFIX = 32  # tokens in the KV cache before the counted decode step
BLOCK = 16
H100_SMS = 132  # the GPU path's split-KV, as paged_attention._num_splits picks it on an H100


# ---- 1. ops per decoder layer at real shapes ----------------------------------------------------
def _runner(path: str, fmt: str | None, gpu_path: bool = False, layers: int = 2, graphs: int = 0):
    """`path`'s model with two decoder layers (the first does the step's once-per-step attention
    work, the second is a plain layer) and dummy weights (load_format="dummy"), in format `fmt` (None: the target's
    packed fp32); `gpu_path`: with a GPU's attention backend and layer kernels, interpreted; `graphs`:
    CUDA graphs' row cap (emulated on CPU; 0: none)."""
    import torch

    from ssd_engine.core.config_sections import CacheConfig, ModelConfig
    from ssd_engine.layers.weight_formats import ACTIVATION_DTYPE
    from ssd_engine.models.loader import load_config
    from ssd_engine.runtime.model_runner import RunnerSpec
    from ssd_engine.testing import emulated_cuda_graphs

    hf_config = load_config(path)
    real_layers = hf_config.num_hidden_layers
    hf_config.num_hidden_layers = layers
    dtype = "float32" if fmt is None or ACTIVATION_DTYPE[fmt] == torch.float32 else "bfloat16"
    model = ModelConfig(
        path,
        dtype=dtype,
        device="cpu",
        weight_layout="packed",
        weight_format=fmt,
        load_format="dummy",
        attention_backend="triton" if gpu_path else "torch",
        fused_kernels="on" if gpu_path else "off",
        graph_max_batch=graphs,
    )
    blocks = -(-(PREFIX + 2) // BLOCK)
    with emulated_cuda_graphs(bool(graphs)):
        runner = RunnerSpec(model, CacheConfig(BLOCK, blocks), PREFIX + 2).build(
            hf_config=hf_config
        )
    return runner, real_layers, blocks


def layer_counts(path: str, fmt: str | None, gpu_path: bool = False) -> dict:
    """One decode step's ops by scope: each of two layers, the rest of the forward, and sampling."""
    import torch

    from instrumentation.op_count import OpCounter
    from ssd_engine import SamplingParams
    from ssd_engine.core.structures import Sequence
    from ssd_engine.runtime.step_inputs import StepInputs
    from ssd_engine.sampling.verifier import Verifier

    runner, num_layers, blocks = _runner(path, fmt, gpu_path)
    vocab = runner.config.vocab_size
    table = list(range(blocks))
    runner.run(StepInputs([0], [[(3 + i) % vocab for i in range(PREFIX)]], [table], [[PREFIX - 1]]))
    verifier = Verifier(torch.Generator().manual_seed(0))
    greedy, sampled = (
        [Sequence([3, 4], SamplingParams(temperature=t, seed=0), BLOCK)] for t in (0.0, 0.7)
    )
    ops = OpCounter()
    layers = list(runner.model.model.layers)
    with ops.scoped(layers, ["layer 0", "layer 1"]), ops, _h100_splits():
        logits = runner.run(StepInputs([PREFIX], [[42 % vocab]], [table], [[0]]))
        with ops.scope("sampling, greedy"):
            verifier.sample(greedy, logits)
        with ops.scope("sampling, T = 0.7"):
            verifier.sample(sampled, logits)
    first, plain = ops.total("layer 0"), ops.total("layer 1")
    outside = ops.total("step")
    sites = _sites(ops, "layer 1")
    return {
        "layers": num_layers,
        "per_layer": plain,
        "per_layer_compute": ops.total("layer 1", "compute"),
        "torch_attention": sum(s["calls"] for s in sites if s["site"].endswith(" torch_attention")),
        "first_layer_extra": first - plain,
        "outside_layers": outside,
        "sampling_greedy": ops.total("sampling, greedy"),
        "sampling_t07": ops.total("sampling, T = 0.7"),
        "step_total": num_layers * plain + first - plain + outside + ops.total("sampling, greedy"),
        "by_op": {f"{op} ({kind})": n for (op, kind), n in sorted(ops.by("op", "layer 1").items())},
        "by_site": sites,
    }


@contextlib.contextmanager
def _h100_splits():
    """Split-KV attention as on an H100 (on CPU the kernel runs one split): its merge is a launch."""
    from ssd_engine.kernels import paged_attention

    if paged_attention.triton is None:
        yield
        return
    saved = paged_attention._num_splits
    paged_attention._num_splits = lambda programs, device: max(
        1, min(paged_attention.MAX_SPLITS, -(-2 * H100_SMS // programs))
    )
    try:
        yield
    finally:
        paged_attention._num_splits = saved


def _sites(ops, scope: str) -> list[dict]:
    """[{site, op, kind, calls}] of one scope, in file and line order."""
    merged: dict = {}
    for (s, op, kind, site), n in ops.counts.items():
        if s == scope:
            merged[(site, op, kind)] = merged.get((site, op, kind), 0) + n

    def order(key):
        path, _, rest = key[0].partition(":")
        line = rest.split(" ")[0]
        return path, int(line) if line.isdigit() else 0, key[1]

    return [
        {"site": site, "op": op, "kind": kind, "calls": n}
        for (site, op, kind), n in sorted(merged.items(), key=lambda item: order(item[0]))
    ]


def model_rows(target: str, draft: str, formats: list[str], gpu_path: bool = True) -> list[dict]:
    rows = [{"model": "target", "format": "fp32", **layer_counts(target, None)}]
    rows += [{"model": "draft", "format": fmt, **layer_counts(draft, fmt)} for fmt in formats]
    if gpu_path:  # fp32: the interpreter's bf16 is wrong, and the kernels are the same for bf16
        rows += [
            {"model": model, "format": "fp32, GPU path", **layer_counts(path, None, gpu_path=True)}
            for model, path in (("target", target), ("draft", draft))
        ]
    return rows


# ---- 2. host launches of a prefill chunk --------------------------------------------------------
def prefill_launches(path: str) -> dict:
    """A PREFIX-token prefill on the GPU path, counted eagerly and with piecewise graphs
    (runtime/piecewise_graphs.py, emulated; each piece's replay one launch): the launches the host
    issues (compute ops) and all its ops, per decoder layer (3 layers minus 2) and in total at the
    model's depth."""
    from instrumentation.op_count import OpCounter
    from ssd_engine.runtime.step_inputs import StepInputs

    counts = {}
    for graphs in (0, 4):
        for layers in (2, 3):
            runner, depth, blocks = _runner(path, None, gpu_path=True, layers=layers, graphs=graphs)
            prefill = StepInputs(
                [0], [[3 + i for i in range(PREFIX)]], [list(range(blocks))], [[PREFIX - 1]]
            )
            runner.run(prefill)  # makes the emulated graphs of the bucket
            ops = OpCounter()
            replays = 0
            if graphs:

                def counted(replay):
                    def run():
                        nonlocal replays
                        replays += 1
                        with ops.scope("replay"):
                            replay()

                    return run

                for size, pieces in runner.piecewise.graphs.items():
                    runner.piecewise.graphs[size] = [counted(piece) for piece in pieces]
            with ops:
                runner.run(prefill)
            counts[graphs, layers] = (
                ops.total("step", "compute") + replays,
                ops.total("step") + replays,
            )
    row = {"tokens": PREFIX, "layers": depth}
    for graphs, name in ((0, "eager"), (4, "piecewise")):
        for index, what in enumerate(("launches", "ops")):
            per_layer = counts[graphs, 3][index] - counts[graphs, 2][index]
            row[f"{name}_{what}_per_layer"] = per_layer
            row[f"{name}_{what}"] = counts[graphs, 2][index] + (depth - 2) * per_layer
    return row


# ---- 3. ops and syncs per engine step on a tiny pair --------------------------------------------
def tiny_pair(root: str) -> tuple[str, str]:
    from tiny_checkpoints import build_checkpoint

    return (
        build_checkpoint(os.path.join(root, "target"), "qwen2", seed=0),
        build_checkpoint(os.path.join(root, "draft"), "qwen2", seed=0, num_hidden_layers=1),
    )


def engine_rows(
    target: str, draft: str, modes: list[str], k: int, steps: int, draft_dtype: str
) -> list[dict]:
    """Per mode and temperature: `steps` decode steps under the op counter and `steps` more under
    the sync counter, after the prefill and one round (an SSD sequence's first round is a certain
    cache miss)."""
    from instrumentation.step_count import count_ops, count_syncs, op_summary, sync_summary
    from ssd_engine import LLM, SamplingParams

    rows = []
    for mode in modes:
        options = dict(speculative_mode=mode, num_threads=1, max_model_len=256)
        if mode != "ar":
            options.update(draft_model=draft, num_speculative_tokens=k, draft_dtype=draft_dtype)
        with LLM(target, **options) as llm:
            engine = llm.engine
            for temperature in TEMPERATURES:
                seq = engine.add_request(
                    list(range(3, 20)),
                    SamplingParams(
                        temperature=temperature, seed=0, max_tokens=200, ignore_eos=True
                    ),
                )
                engine.step()
                engine.step()
                ops = [op_summary(count_ops(engine)) for _ in range(steps)]
                syncs = [sync_summary(count_syncs(engine)) for _ in range(steps)]
                engine.abort(seq)
                rows.append(
                    {
                        "mode": mode,
                        "temperature": temperature,
                        "k": k if mode != "ar" else None,
                        "ops_steps": ops,
                        "sync_steps": syncs,
                    }
                )
    return rows
