"""Pick the attention backend for a device (torch reference, CPU kernel, Triton, or flash-attn);
one that cannot run here is an error naming why, never a silent switch."""

import os

import torch

from ssd_engine.layers.attention import (
    AttentionMetadata,
    Backend,
    cpu_kernel_attends,
    row_independent_attention,
    torch_attention,
)

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
FLASH_ATTN_BLOCK = 256  # flash_attn_with_kvcache needs paged KV blocks of a multiple of 256 tokens


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    try:
        from ssd_engine.kernels.paged_attention import triton
    except ImportError:
        return False
    return triton is not None


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def triton_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    from ssd_engine.kernels.paged_attention import paged_attention, tree_attention

    if q.device.type == "cpu" and q.dtype != torch.float32:
        # Triton's CPU interpreter (tests only) computes bf16 wrongly, so it runs in fp32 there
        return triton_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale).to(
            q.dtype
        )
    if meta.is_tree:
        return tree_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.table_rows,
            meta.kv_lens,
            meta.path_slots,
            meta.path_lens,
            meta.block_size,
            scale,
            meta.query_start,
        )
    return paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.kv_lens,
        meta.query_start,
        meta.max_query_len,
        meta.block_size,
        scale,
    )


def flash_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Paged steps on flash-attn's kernel (one uniform query length per step); others on Triton."""
    rows = meta.kv_lens.shape[0]
    if meta.is_tree or q.shape[0] != rows * meta.max_query_len:
        return triton_attention(q, k_cache, v_cache, meta, scale)
    from flash_attn import flash_attn_with_kvcache

    # flash-attn aligns the causal mask at the bottom right: query i of n sees keys < kv_len - n + i + 1
    blocks = k_cache.view(-1, meta.block_size, *k_cache.shape[1:])
    out = flash_attn_with_kvcache(
        q.view(rows, meta.max_query_len, *q.shape[1:]),
        blocks,
        v_cache.view(-1, meta.block_size, *v_cache.shape[1:]),
        cache_seqlens=meta.kv_lens,
        block_table=meta.block_tables,
        softmax_scale=scale,
        causal=True,
    )
    return out.reshape(q.shape)


def select_backend(name: str, device: torch.device, block_size: int) -> Backend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    on_cuda = device.type == "cuda"
    if name == "auto":
        if not on_cuda:
            return row_independent_attention if cpu_kernel_attends(device) else torch_attention
        if flash_attn_available() and block_size % FLASH_ATTN_BLOCK == 0:
            return flash_attention
        return triton_attention if triton_available() else torch_attention
    if name == "torch":
        return torch_attention
    if name == "triton":
        if not triton_available():
            raise ValueError(
                "attention_backend='triton' needs the triton package (pip install triton)"
            )
        if not on_cuda and not _interpreting():
            raise ValueError(
                "attention_backend='triton' on CPU needs TRITON_INTERPRET=1 (Triton's interpreter, "
                "for testing the kernels); use 'torch' or 'auto' for CPU inference"
            )
        return triton_attention
    if not on_cuda:
        raise ValueError("attention_backend='flash-attn' needs a CUDA device")
    if not flash_attn_available():
        raise ValueError(
            "attention_backend='flash-attn' needs the flash-attn package (pip install flash-attn)"
        )
    if block_size % FLASH_ATTN_BLOCK:
        raise ValueError(
            f"attention_backend='flash-attn' needs block_size to be a multiple of {FLASH_ATTN_BLOCK}, "
            f"got {block_size}"
        )
    return flash_attention


def backend_name(backend: Backend, device: torch.device) -> str:
    if backend is row_independent_attention:
        return "cpu-kernel" if cpu_kernel_attends(device) else "torch-fixed-blocks"
    return {torch_attention: "torch", triton_attention: "triton", flash_attention: "flash-attn"}[
        backend
    ]
