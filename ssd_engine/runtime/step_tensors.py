"""One step's plain lists (`StepInputs`) as flat device tensors and attention metadata, one upload."""

import torch

from ssd_engine.layers.attention import AttentionMetadata
from ssd_engine.runtime.step_inputs import StepInputs
from ssd_engine.utils.host_upload import padded_rows, to_device, upload


def step_tensors(inputs: StepInputs, block_size: int, device: torch.device):
    """Flat input ids and positions, the attention metadata, and the flat index of the rows
    `inputs.logit_rows` names, on `device`; one upload."""
    bs = block_size
    ids, positions, slots, kv_lens, query_start, logit_index = [], [], [], [], [0], []
    for start, fed, table, rows in zip(
        inputs.starts, inputs.token_ids, inputs.block_tables, inputs.logit_rows
    ):
        end = start + len(fed)
        logit_index.extend(len(ids) + r for r in rows)
        ids.extend(fed)
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        kv_lens.append(end)
        query_start.append(query_start[-1] + len(fed))
    max_kv = max(kv_lens)
    blocks = -(-max_kv // bs)
    held_at, held = inputs.on_device or ([], None)
    ids_t, positions_t, slots_t, kv_lens_t, query_start_t, tables_t, held_at_t, logit_index_t = (
        upload(
            [
                ids,
                positions,
                slots,
                kv_lens,
                query_start,
                padded_rows(inputs.block_tables, blocks),
                held_at,
                logit_index,
            ],
            device,
            torch.int32,
        )
    )  # int32 throughout: no casts on the device
    if held is not None:  # device-held fed tokens written in place there: no host read
        held = held.to(device) if held.device.type != "cpu" else to_device(held, device)
        ids_t = (
            held
            if held_at == list(range(len(ids)))
            else ids_t.index_put_((held_at_t,), held.to(torch.int32))
        )
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        block_tables=tables_t.view(len(kv_lens), blocks),
        kv_lens=kv_lens_t,
        query_start=query_start_t,
        max_query_len=max(len(fed) for fed in inputs.token_ids),
        max_kv_len=max_kv,
        block_size=bs,
    )
    return ids_t, positions_t, meta, logit_index_t
