"""One copy of every weight, and RSS only where memory is used (issue 19, item 1).

Without the 1.5B model: a tiny checkpoint loaded with the default layout holds exactly the
checkpoint's bytes (the old one-thread default, "dual", held two copies of every Linear); the
embedding is a mapping of the checkpoint file of which only looked-up rows become resident; the
KV cache costs nothing until written; loading packs layer by layer, so no plain copy outlives it.
"""

import os
import struct

import pytest
import torch
from runners import tiny_runner

from ssd_engine.core.config import EngineConfig
from ssd_engine.layers.linear import Linear
from ssd_engine.runtime.model_runner import ModelRunner
from ssd_engine.utils.memory import lazy_zeros, map_rows, safetensors_header


def runner(path: str, layout: str) -> ModelRunner:
    return tiny_runner(
        path, num_kv_blocks=64, block_size=16, max_position=256, weight_layout=layout
    )


def checkpoint_bytes(path: str) -> int:
    header, _ = safetensors_header(os.path.join(path, "model.safetensors"))
    return sum(end - begin for begin, end in (entry["data_offsets"] for entry in header.values()))


def weight_bytes(model) -> int:
    """Bytes of every distinct storage behind parameters, plus the packed Linear weights (oneDNN's
    opaque tensors: their element count; buffers such as the rotary tables are not weights)."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    prepared = [
        m.prepared for m in model.modules() if isinstance(m, Linear) and m.prepared is not None
    ]
    return sum(storages.values()) + sum(p.nbytes for p in prepared)


def mapping_rss(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s own pages mapped in this process (present bits in /proc/self/pagemap).
    Not the VMA's Rss in smaps: the kernel may merge a new anonymous mapping with a neighbour
    that is already resident, so that figure is not the tensor's."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    first, last = start // page, (start + tensor.numel() * tensor.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{last - first + 1}Q", f.read((last - first + 1) * 8))
    return sum(entry >> 63 & 1 for entry in entries) * page


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_default_layout_keeps_one_copy(threads):
    layout = lambda **options: (
        EngineConfig.from_kwargs(num_threads=threads, **options).model.weight_layout
    )
    assert layout() == "packed"
    assert layout(cpu_weight_layout="dual") == "dual"
    assert layout(enforce_eager=True) == "plain"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # untied head; tied head (llama)
def test_default_layout_holds_the_checkpoint_once(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    size = checkpoint_bytes(path)
    model = runner(path, EngineConfig().model.weight_layout).model
    assert all(
        m.weight is None
        for m in model.modules()
        if isinstance(m, Linear) and m.prepared is not None
    )
    assert weight_bytes(model) == size
    assert weight_bytes(runner(path, "plain").model) == size
    # "dual" is the opt-in second copy: every Linear twice (a tied head's table included)
    assert weight_bytes(runner(path, "dual").model) > 1.8 * size


def test_embedding_is_mapped_and_only_looked_up_rows_become_resident(tiny_model_dir):
    # a 64 MB table (2^18 x 64 fp32, tied so the file holds it once): a few rows are a small part
    # of it even though the kernel maps a fault's neighbours too (read-around, large folios: <= 2 MB)
    path = tiny_model_dir("llama", vocab_size=2**18)
    model = runner(path, "packed").model
    table = model.model.embed_tokens.weight
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if line.rstrip().endswith("model.safetensors")]
    address = table.data_ptr()
    assert any(
        int(m.split()[0].split("-")[0], 16) <= address < int(m.split()[0].split("-")[1], 16)
        for m in mapped
    )
    size = table.numel() * table.element_size()
    assert mapping_rss(table) < size / 8  # loading did not read the table
    ids = [5, 90000, 260000]
    rows = model.model.embed_tokens(torch.tensor(ids))
    assert mapping_rss(table) < size / 4  # three rows and their neighbours, not the table
    with safe_open_tensor(path, "model.embed_tokens.weight") as expected:
        assert torch.equal(rows, expected[ids])


class safe_open_tensor:
    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = os.path.join(path, "model.safetensors"), name

    def __enter__(self) -> torch.Tensor:
        from safetensors import safe_open

        self.file = safe_open(self.path, "pt", "cpu").__enter__()
        return self.file.get_tensor(self.name)

    def __exit__(self, *exc) -> None:
        self.file.__exit__(*exc)


def test_map_rows_reads_a_slice_of_the_file(tmp_path):
    from safetensors.torch import save_file

    table = torch.arange(5000 * 7, dtype=torch.float32).view(5000, 7)
    save_file({"a": torch.ones(3), "table": table}, str(tmp_path / "m.safetensors"))
    rows = map_rows(
        str(tmp_path / "m.safetensors"), "table", 1234, 100
    )  # an offset off any page boundary
    assert torch.equal(rows, table[1234:1334])
    rows[0, 0] = -1.0  # a private mapping: writable, never written back
    assert torch.equal(
        map_rows(str(tmp_path / "m.safetensors"), "table", 1234, 1), table[1234:1235]
    )


def test_lazy_zeros_cost_nothing_until_written():
    kv = lazy_zeros((2, 4, 2**20, 8), torch.float32, torch.device("cpu"))  # 256 MB
    assert mapping_rss(kv) == 0
    assert (
        kv[1, 3, -5:].abs().sum().item() == 0.0
    )  # reads see zeros (the shared zero page: one page)
    kv[0, 0, :1024] = 1.0  # 32 KB written
    assert 0 < mapping_rss(kv) <= 4 * 2**20  # those pages (huge pages at most), not 256 MB
    assert kv.sum().item() == 1024 * 8
    half = lazy_zeros((3, 5), torch.bfloat16, torch.device("cpu"))
    assert half.dtype == torch.bfloat16 and half.shape == (3, 5) and not half.any()


def test_the_engine_freezes_its_built_heap_and_thaws_it_at_close(tiny_qwen2):
    """A full collection skips what the engine built (frozen at start-up); after close() the same
    objects are collectable again, so an engine that goes away leaves no frozen cycles behind."""
    import gc

    from ssd_engine import LLM

    llm = LLM(tiny_qwen2, num_threads=1)
    try:
        assert gc.get_freeze_count() > 0
    finally:
        llm.close()
    assert gc.get_freeze_count() == 0
