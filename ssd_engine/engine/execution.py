"""What the `[engine]` line says of how an engine runs its target."""

from ssd_engine.layers.attention_backends import backend_name
from ssd_engine.layers.weight_formats import describe_target_format
from ssd_engine.speculative import prompt_window

# what the mode line adds where SD chooses K every step (engine/step_choice.py)
PER_STEP_NOTE = " (each step any K from 0 to {k}, by predicted tokens/s)"


def describe_execution(engine) -> dict:
    """How this engine runs its target: device, dtype, attention, graphs, compiling, weights."""
    runner = engine.runner.local  # rank 0's own ModelRunner under tensor parallelism
    graphs = runner.graphs
    described = {
        "device": str(engine.device),
        "dtype": engine.config.model.dtype,
        "attention": backend_name(runner.attention_backend, runner.device),
        "cuda_graphs": f"batch <= {graphs.sizes[-1]} ({graphs.capture})" if graphs else "off",
        "compiled": f"on ({runner.compiled.compile_seconds:.0f}s)" if runner.compiled else "off",
        "fused_kernels": "on" if runner.layer_ops is not None else "off",
    }
    described["target_dtype"] = describe_target_format(
        runner.weight_format, engine.config.model.weight_format
    )
    described["mode"] = engine.plan.describe_mode()
    if engine.step_choice is not None:
        described["mode"] += PER_STEP_NOTE.format(k=engine.k)
    if engine.plan.draft_format is not None:
        described["draft_format"] = engine.plan.draft_format.describe()
    if engine.speculator is not None:
        described["draft_reads"] = prompt_window.describe(engine.speculator.prompt_window)
    return described
