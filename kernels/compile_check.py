"""Compile the Triton kernels to cubins for sm_80 / sm_90 ahead of time, on a machine without a GPU,
catching what the interpreter cannot: loop-carried types, `tl.dot` shapes, register or shared-memory
overflow. Exits 1 if any variant fails; run it without TRITON_INTERPRET."""

import inspect
import os
import sys

# (dtype, tree, splits, GQA group, max query len, head dim): the engine's decode, split-KV,
# verification, prefill-chunk and tree steps; fp32 for exactness runs; a head dim not a power of 2
VARIANTS = [
    ("bf16", False, 1, 6, 1, 128),
    ("bf16", False, 8, 6, 1, 128),
    ("bf16", False, 1, 6, 5, 128),
    ("bf16", False, 1, 7, 512, 64),
    ("bf16", True, 4, 7, 1, 64),
    ("fp32", False, 1, 2, 16, 40),
    ("fp32", True, 3, 3, 1, 64),
]


def compile_variant(
    dtype: str,
    tree: bool,
    splits: int,
    group: int,
    max_query_len: int,
    head_dim: int,
    arch: int = 90,
):
    import triton
    from ssd_engine.kernels.paged_attention import block_config
    from ssd_engine.kernels.paged_attention_kernels import _paged_attn_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(_paged_attn_kernel.fn).parameters)
    data = {"fp32": "*fp32", "bf16": "*bf16"}[dtype]
    pointers = {
        "q_ptr": data,
        "k_ptr": data,
        "v_ptr": data,
        "out_ptr": data if splits == 1 else "*fp32",
        "m_ptr": "*fp32",
        "l_ptr": "*fp32",
        "path_ptr": "*i64",
    }
    config = block_config(group, max_query_len, head_dim, 16, tree, splits, dtype == "fp32")
    signature = {
        n: "constexpr" if n in config else pointers.get(n, "*i32" if n.endswith("_ptr") else "i32")
        for n in names
    }
    signature["scale"] = "fp32"
    source = ASTSource(
        fn=_paged_attn_kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in config.items()},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


# the other kernels at the engine's model shapes: (kernel, pointer dtype, constexprs)
OTHER_KERNELS = [
    ("add_rms_norm", "bf16", dict(HAS_RESIDUAL=True, BLOCK=2048)),
    ("add_rms_norm", "bf16", dict(HAS_RESIDUAL=False, BLOCK=4096)),
    ("add_rms_norm", "fp32", dict(HAS_RESIDUAL=True, BLOCK=1024)),
    ("rope_cache_write", "bf16", dict(QK_NORM=False, HALF=64)),
    ("rope_cache_write", "bf16", dict(QK_NORM=True, HALF=64)),
    ("rope_cache_write", "fp32", dict(QK_NORM=False, HALF=32)),
    ("silu_mul", "bf16", dict(BLOCK=1024)),
    ("merge_splits", "bf16", dict(SPLITS=16, BLOCK_S=16, BLOCK_D=128)),
    ("merge_splits", "fp32", dict(SPLITS=3, BLOCK_S=4, BLOCK_D=64)),
]


def compile_other(name: str, dtype: str, constexprs: dict, arch: int = 90):
    """A kernel whose pointers are all activations (`dtype`) but for these named ones."""
    import triton
    from ssd_engine.kernels import fused_layer_ops, paged_attention_kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = {
        "add_rms_norm": fused_layer_ops._add_rms_norm_kernel,
        "rope_cache_write": fused_layer_ops._rope_cache_write_kernel,
        "silu_mul": fused_layer_ops._silu_mul_kernel,
        "merge_splits": paged_attention_kernels._merge_splits_kernel,
    }[name]
    special = {
        "slot_ptr": "*i64",
        "part_ptr": "*fp32",
        "m_ptr": "*fp32",
        "l_ptr": "*fp32",
        "eps": "fp32",
    }
    data = {"fp32": "*fp32", "bf16": "*bf16"}[dtype]
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {
        n: "constexpr" if n in constexprs else special.get(n, data if n.endswith("_ptr") else "i32")
        for n in names
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    failed = 0
    for arch in (80, 90):
        for variant in VARIANTS:
            try:
                kernel = compile_variant(*variant, arch=arch)
                print(f"ok   sm_{arch} {variant} shared memory {kernel.metadata.shared} B")
            except Exception as error:  # report every variant, then fail
                failed += 1
                print(f"FAIL sm_{arch} {variant}: {type(error).__name__}: {str(error)[:2000]}")
        for name, dtype, constexprs in OTHER_KERNELS:
            try:
                compile_other(name, dtype, constexprs, arch=arch)
                print(f"ok   sm_{arch} {name} {dtype} {constexprs}")
            except Exception as error:
                failed += 1
                print(
                    f"FAIL sm_{arch} {name} {dtype} {constexprs}: {type(error).__name__}: {str(error)[:2000]}"
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
