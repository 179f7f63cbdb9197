"""The compiled forward (compile_model="on", runtime/compiled_model.py) against the eager one.

fp32 logits within 1e-5 relative for every step shape the engine runs (ragged prefill, one-token
decode, batched decode, K+1 verification, SSD tree-branch steps), with no recompilation after the
start-up warm-up; greedy SD with a compiled target and draft stays token-identical to transformers;
and a compiled layer launches at most 10 kernels where the eager one dispatches 36 aten ops.
`pytest tests/test_greedy_generation.py tests/test_model_equivalence.py --compile-model` runs those
files with every runner compiled (conftest.py).
"""

import json

import pytest
import torch
from runners import tiny_runner
from test_greedy_generation import GREEDY, _prompts, oracle_outputs  # noqa: F401 (fixture)
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

from ssd_engine import LLM
from ssd_engine.runtime.compiled_model import CompiledModel
from ssd_engine.runtime.model_runner import ModelRunner
from ssd_engine.runtime.step_inputs import StepInputs
from ssd_engine.speculative.ssd.draft.tree_mask import branch_metadata

REL_TOL = 1e-5
BLOCK = 4


def _runner(path: str, compiled: bool, layout: str = "packed") -> ModelRunner:
    # eager = torch's ops (no fused layer ops): what a compiled forward replaces
    return tiny_runner(
        path,
        num_kv_blocks=64,
        block_size=BLOCK,
        max_position=256,
        weight_layout=layout,
        compile=compiled,
        fused_kernels="off",
    )


def _steps(prompts: list[list[int]]) -> list[StepInputs]:
    """A ragged prefill, then decode of one sequence, decode of all, and a K = 4 verification of two."""
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    return [
        StepInputs([0] * len(prompts), prompts, tables, [[n - 1] for n in lens]),
        StepInputs([lens[0]], [[7]], tables[:1], [[0]]),
        StepInputs(lens, [[8] for _ in prompts], tables, [[0] for _ in prompts]),
        StepInputs(
            [n + 1 for n in lens[:2]], [[9, 10, 11, 12, 13]] * 2, tables[:2], [list(range(5))] * 2
        ),
    ]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_compiled_logits_match_eager_without_recompiling(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    eager, compiled = _runner(path, False), _runner(path, True)
    assert compiled.compiled is not None and eager.compiled is None
    prompts = [list(range(5, 12)), list(range(40, 53)), [7, 8, 9]]
    # warm_up compiled every graph a step needs
    with torch.compiler.set_stance("fail_on_recompile"):
        for step in _steps(prompts):
            want, got = eager.run(step), compiled.run(step)
            assert _relative_error(got, want) < REL_TOL


def test_compiled_tree_steps_match_eager(tiny_qwen3):
    """SSD branch steps (run_metadata with tree metadata): three branches off one trunk, two steps."""
    runners = [_runner(tiny_qwen3, False), _runner(tiny_qwen3, True)]
    trunk = list(range(20, 33))
    logits = []
    for runner in runners:
        runner.run(StepInputs([0], [trunk], [list(range(8))], [[len(trunk) - 1]]))
        tables = torch.tensor([list(range(8))], dtype=torch.int32)
        visible = torch.tensor([len(trunk), len(trunk) - 2, len(trunk) - 5])
        scratch = (40 * BLOCK + torch.arange(3 * 2)).view(3, 2)  # blocks 40..41: no trunk's
        ids, out = torch.tensor([3, 4, 5]), []
        for step in range(2):
            meta = branch_metadata(
                tables, torch.zeros(3, dtype=torch.long), visible, len(trunk), scratch, step, BLOCK
            )
            out.append(runner.run_metadata(ids, visible + step, meta))
            ids = out[-1].argmax(-1)
        logits.append(torch.cat(out))
    assert _relative_error(logits[1], logits[0]) < REL_TOL


def test_small_padded_steps_run_eagerly(tiny_qwen2, monkeypatch):
    """Where oneDNN pads 2- and 3-row steps (layers/row_padding.py), they skip the compiled graphs
    (one static graph per count otherwise); one row and four or more still compile."""
    from ssd_engine.layers import row_padding

    monkeypatch.setitem(row_padding._padded, torch.float32, {1: 4, 2: 4, 3: 4})
    runner = _runner(tiny_qwen2, True)
    assert runner.compiled.padded == 3
    assert [runner.compiled.compiles(n) for n in (1, 2, 3, 4, 9)] == [
        True,
        False,
        False,
        True,
        True,
    ]


class _AtenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_compiled_layer_launches_at_most_ten_kernels(tiny_qwen2):
    """Eager: every aten op of a decode step's layers; compiled: what the graph calls per layer
    (fused C++ kernels, matmuls, the attention op), from the profiler's per-kernel records."""
    import torch._inductor.config as inductor_config

    runner = _runner(tiny_qwen2, False)
    model = runner.model.model
    runner.run(StepInputs([0], [list(range(3, 20))], [list(range(8))], [[16]]))
    ids, positions, meta = runner.prepare(StepInputs([17], [[5]], [list(range(8))], [[0]]))
    layers = len(model.layers)
    with torch.inference_mode():
        counter = _AtenOps()
        with counter:
            model(ids, positions, meta)
        with inductor_config.patch({"cpp.enable_kernel_profile": True}):
            compiled = CompiledModel(model)
            compiled(ids, positions, meta)
        with profile() as prof:
            compiled(ids, positions, meta)
    graph_calls = [
        e
        for e in prof.events()
        if e.cpu_parent is not None and e.cpu_parent.name.startswith("## Call CompiledFxGraph")
    ]
    assert (
        sum(e.name == "ssd_engine::paged_attention" for e in graph_calls) == layers
    )  # attention stayed eager
    assert counter.count / layers > 40
    # per layer: 4 matmuls, the attention op, norm(s) + residuals, RoPE, SiLU-mul (and, where one-row
    # matmuls are padded, the attention output's padding): at most 10; plus the final norm once
    assert len(graph_calls) <= 10 * layers + 1, "\n".join(e.name for e in graph_calls)


def test_greedy_sd_compiled_matches_transformers(tiny_model_dir, oracle_outputs):
    """Target and SD draft both compiled: greedy output is still transformers' own."""
    with LLM(
        tiny_model_dir("qwen2"),
        draft_model=tiny_model_dir("qwen2", seed=1),
        speculative_mode="sd",
        block_size=8,
        compile_model="on",
    ) as llm:
        assert (
            llm.engine.runner.compiled is not None
            and llm.engine.speculator.runner.compiled is not None
        )
        assert llm.engine.execution()["compiled"].startswith("on")
        outputs = llm.generate(_prompts(3), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == oracle_outputs("qwen2", 3)


def test_enforce_eager_and_off_compile_nothing(tiny_qwen2):
    for options in ({"compile_model": "off"}, {"compile_model": "on", "enforce_eager": True}, {}):
        with LLM(tiny_qwen2, speculative_mode="ar", **options) as llm:
            assert llm.engine.runner.compiled is None
            assert llm.engine.execution()["compiled"] == "off"


def test_the_option_reaches_the_drafts_specs():
    """compile_model travels in ModelConfig: the SD draft's spec is the target's with another path,
    and the SSD draft process rebuilds its spec, the engine's config with it, from plain values."""
    from ssd_engine.core.config import EngineConfig
    from ssd_engine.core.config_sections import CacheConfig
    from ssd_engine.runtime.model_runner import RunnerSpec
    from ssd_engine.speculative.ssd.process import DraftSpec
    from ssd_engine.testing import Synthetic

    assert EngineConfig.from_kwargs(compile_model="on").model.compile
    assert not EngineConfig.from_kwargs(compile_model="on", enforce_eager=True).model.compile
    assert not EngineConfig().model.compile  # auto: off
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(compile_model="on", tensor_parallel_size=2)
    target = RunnerSpec(EngineConfig.from_kwargs(compile_model="on").model, CacheConfig(16, 8), 64)
    draft = DraftSpec(
        target.with_model(path="/draft"),
        EngineConfig.from_kwargs(max_num_seqs=1, seed=7, synthetic=Synthetic(hit=0.5)),
        ((0.0, (1, 1, 1, 1, 1)),),
        (),
        vocab=320,
    )
    rebuilt = DraftSpec.from_args(json.loads(json.dumps(draft.to_args())))  # as the process gets it
    assert rebuilt == draft and rebuilt.config.scheduler.max_num_seqs == 1
