"""The pair behind every T > 0 distribution test: a 16-token vocabulary, so exact laws are cheap.

Qwen2 with vocab_size = 16, hidden 32, one layer; its lm_head is scaled by SHARPNESS (equivalently,
temperature 1/16 on the unscaled model) so the mass sits on a few cells. The draft is the blend
(1 - DRAFT_BLEND) * target + DRAFT_BLEND * (an unrelated random model), scaled the same way:
P(accept) is about one half, so the accept and the residual branches of verification both carry
mass. `small_pair` (tests/conftest.py) builds it once per session.
"""

import os

from safetensors.torch import load_file
from tiny_checkpoints import build_checkpoint, derived_checkpoint

SMALL = dict(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SHARPNESS = 16.0
DRAFT_BLEND = 0.27
DIST_PROMPT = [3, 7, 11, 5, 9]


def build_small_pair(root: str) -> tuple[str, str]:
    base = build_checkpoint(os.path.join(root, "base"), "qwen2", seed=0, **SMALL)
    other = load_file(
        os.path.join(
            build_checkpoint(os.path.join(root, "other"), "qwen2", seed=1, **SMALL),
            "model.safetensors",
        )
    )

    def sharpen(state, blend=0.0):
        state = {
            k: (1 - blend) * v + blend * other[k] if v.dim() == 2 else v for k, v in state.items()
        }
        state["lm_head.weight"] = state["lm_head.weight"] * SHARPNESS
        return state

    target = derived_checkpoint(base, os.path.join(root, "target"), sharpen)
    draft = derived_checkpoint(base, os.path.join(root, "draft"), lambda s: sharpen(s, DRAFT_BLEND))
    return target, draft


def engine_options(**extra) -> dict:
    """Many short requests at once; a small max_model_len keeps the KV allocation small."""
    # draft_dtype int4: every path is tested with the lowest-precision draft, whose q rows come from
    # bf16 logits (its precision must not change the law; the tests of an fp32 draft came first)
    return {
        **dict(
            num_threads=1,
            max_num_seqs=1024,
            max_num_batched_tokens=1 << 16,
            max_model_len=16,
            draft_dtype="int4",
        ),
        **extra,
    }


def sample_outputs(
    small_pair: tuple[str, str],
    mode: str,
    n: int,
    length: int,
    params: dict,
    seeded: bool = False,
    seed: int = 31,
    **options,
):
    """(Counter of output tuples, speculation metrics) of n requests of DIST_PROMPT with `params`, all in one
    engine; seeded requests get seeds 5000 + i."""
    from collections import Counter

    from ssd_engine import LLM, SamplingParams

    target, draft = small_pair
    with LLM(
        target, **engine_options(seed=seed, draft_model=draft, speculative_mode=mode, **options)
    ) as llm:
        engine = llm.engine
        seqs = [
            engine.add_request(
                DIST_PROMPT,
                SamplingParams(max_tokens=length, seed=5000 + i if seeded else None, **params),
            )
            for i in range(n)
        ]
        while engine.has_unfinished():
            engine.step()
        return Counter(tuple(s.output_token_ids) for s in seqs), llm.speculation_metrics()
