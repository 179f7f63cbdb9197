"""How one model is split across tensor-parallel ranks: pure functions, testable without processes.
Column-parallel layers keep a span of rows, row-parallel ones (o, down) the matching input columns,
then all-reduce. Attention splits by whole KV groups; with more ranks than KV heads, each KV head is
replicated on tp / num_kv_heads ranks that split its query heads evenly."""

from dataclasses import dataclass

# The widest GGUF quantization block (K-quants: 256; the others' 32 divide it): row-parallel slices
# on multiples of it are whole blocks, so a GGUF-kept target splits as it is stored.
WEIGHT_BLOCK = 256


@dataclass(frozen=True)
class Span:
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def scaled(self, factor: int) -> "Span":
        return Span(self.start * factor, self.size * factor)


@dataclass(frozen=True)
class HeadShard:
    q: Span  # query heads this rank computes
    kv: Span  # KV heads it holds (replicated across ranks when tp > num_kv_heads)


def even_spans(total: int, parts: int, what: str) -> list[Span]:
    """Split `total` into `parts` contiguous spans whose sizes differ by at most one (larger first)."""
    if total < parts:
        raise ValueError(
            f"cannot split {what} ({total}) across tensor_parallel_size={parts}: "
            f"every rank needs at least one"
        )
    base, extra = divmod(total, parts)
    spans, start = [], 0
    for rank in range(parts):
        size = base + (rank < extra)
        spans.append(Span(start, size))
        start += size
    return spans


def intermediate_spans(intermediate_size: int, parts: int) -> list[Span]:
    """The MLP's hidden units per rank: whole WEIGHT_BLOCKs each where the size is whole blocks and every
    rank gets one (sizes then differ by at most one block: 8960 = 35 blocks -> 18 + 17), else even_spans."""
    blocks, tail = divmod(intermediate_size, WEIGHT_BLOCK)
    if tail or blocks < parts:
        return even_spans(intermediate_size, parts, "intermediate_size")
    return [span.scaled(WEIGHT_BLOCK) for span in even_spans(blocks, parts, "intermediate_size")]


def attention_head_shards(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadShard]:
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        return [
            HeadShard(kv.scaled(group), kv)
            for kv in even_spans(num_kv_heads, tp, "key/value heads")
        ]
    ranks_per_kv = tp // num_kv_heads
    if tp % num_kv_heads:
        raise ValueError(
            f"cannot split attention across tensor_parallel_size={tp}: with more ranks than "
            f"num_key_value_heads={num_kv_heads}, tp must be a multiple of it (each KV head's "
            f"{group} query heads then split over tp / {num_kv_heads} ranks)"
        )
    if group % ranks_per_kv:
        raise ValueError(
            f"cannot split attention across tensor_parallel_size={tp}: each of the "
            f"num_key_value_heads={num_kv_heads} KV heads has {group} query heads "
            f"(num_attention_heads={num_heads}), which do not split evenly over {ranks_per_kv} ranks"
        )
    q_per_rank = group // ranks_per_kv
    return [
        HeadShard(Span(rank * q_per_rank, q_per_rank), Span(rank // ranks_per_kv, 1))
        for rank in range(tp)
    ]


def max_kv_heads_per_rank(hf_config, tp: int) -> int:
    return max(
        s.kv.size
        for s in attention_head_shards(
            hf_config.num_attention_heads, hf_config.num_key_value_heads, tp
        )
    )


def check_splittable(hf_config, tp: int) -> None:
    """Raise ValueError naming the sizes if this checkpoint cannot run on `tp` ranks."""
    attention_head_shards(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
    intermediate_spans(hf_config.intermediate_size, tp)
    even_spans(hf_config.vocab_size, tp, "vocab_size")
