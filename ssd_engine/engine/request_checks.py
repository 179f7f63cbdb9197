"""What makes a request impossible on this engine, said in one line before anything is queued."""

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.runtime.block_manager import BlockManager


def check_request(
    token_ids: list[int],
    params: SamplingParams,
    vocab: int,
    max_model_len: int,
    block_manager: BlockManager,
    max_num_seqs: int,
    k: int,
) -> None:
    """ValueError naming the field at fault (the server's 400 names it as OpenAI's `param`)."""
    if not token_ids:
        raise ValueError("prompt is empty")
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
    if params.n > max_num_seqs:
        raise ValueError(
            f"n ({params.n}) is more than the {max_num_seqs} sequences the engine runs at once "
            f"(max_num_seqs)"
        )
    bad = [t for t in params.logit_bias if not 0 <= t < vocab] + [
        t for t in params.stop_token_ids if not 0 <= t < vocab
    ]
    if bad:
        raise ValueError(
            f"logit_bias / stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
        )
    n = len(token_ids)
    if n > max_model_len:
        raise ValueError(f"prompt has {n} tokens, more than max_model_len={max_model_len}")
    if n + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
            f"exceeds max_model_len={max_model_len}"
        )
    # every sample holds its own pages past the prompt's shared full blocks
    blocks = block_manager.blocks_needed(n + params.max_tokens + k)
    shared = n // block_manager.block_size if params.n > 1 else 0
    if params.n * blocks - (params.n - 1) * shared > block_manager.num_blocks:
        raise ValueError(
            f"request needs {blocks} KV blocks (prompt {n} + max_tokens {params.max_tokens})"
            f"{f' for each of its n={params.n} samples' if params.n > 1 else ''} but the whole KV cache "
            f"has {block_manager.num_blocks}; raise num_kv_blocks"
        )
