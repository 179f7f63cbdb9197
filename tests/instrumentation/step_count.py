"""One engine step's GPU-cost proxies: its ops (op_count.py) and its host syncs (sync_count.py).

`count_ops(engine)` runs `engine.step()` under the op counter, with every decoder layer of the
target (and of an SD draft, which runs in this process) in a scope of its own, so a round's ops
split into decoder-layer ops and the rest (input preparation, LM head, sampling, verification);
`count_syncs(engine)` runs one under the sync counter. Each counter gets steps of its own: the
sync counter's bookkeeping would show up among the ops. An SSD draft runs in its own process:
only the coordinator's side is counted.
"""

from instrumentation.op_count import OpCounter
from instrumentation.sync_count import SyncCounter

TARGET_LAYER, DRAFT_LAYER = "target layer", "draft layer"


def decoder_layers(engine) -> tuple[list, list[str]]:
    """(modules, scope names): the target's decoder layers (this rank's, under tensor
    parallelism) and those of a draft that runs in this process (SD)."""
    modules = list(engine.runner.local.model.model.layers)
    names = [TARGET_LAYER] * len(modules)
    draft = getattr(engine.speculator, "runner", None)
    if draft is not None:
        modules += list(draft.model.model.layers)
        names += [DRAFT_LAYER] * len(draft.model.model.layers)
    return modules, names


def count_ops(engine) -> OpCounter:
    """Run one `engine.step()` under the op counter, decoder layers scoped."""
    ops = OpCounter()
    modules, names = decoder_layers(engine)
    with ops.scoped(modules, names), ops:
        engine.step()
    return ops


def count_syncs(engine) -> SyncCounter:
    """Run one `engine.step()` under the sync counter."""
    with SyncCounter() as syncs:
        engine.step()
    return syncs


def op_summary(ops: OpCounter) -> dict:
    """One step's op counts as plain numbers (JSON-ready)."""
    layer_ops = ops.total(TARGET_LAYER) + ops.total(DRAFT_LAYER)
    return {
        "ops": ops.total(),
        "compute_ops": ops.total(kind="compute"),
        "layer_ops": layer_ops,
        "other_ops": ops.total() - layer_ops,
        "target_layer_calls": ops.calls[TARGET_LAYER],
        "draft_layer_calls": ops.calls[DRAFT_LAYER],
    }


def sync_summary(syncs: SyncCounter) -> dict:
    """One step's syncs as plain numbers (JSON-ready): the total and `kind @ site` -> count."""
    return {
        "syncs": sum(syncs.counts.values()),
        "syncs_by_site": {
            f"{kind} @ {site}": n for (kind, site), n in sorted(syncs.counts.items())
        },
    }
