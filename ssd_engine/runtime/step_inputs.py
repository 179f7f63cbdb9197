"""`StepInputs`: one forward step as plain lists, as sent to tensor-parallel workers."""

from dataclasses import dataclass, replace

import torch

from ssd_engine.core.structures import ScheduledBatch


@dataclass
class StepInputs:
    """Everything a forward pass needs as plain lists, except fed tokens still on the device (draft
    tokens: reading them on the host would wait for the draft's last step)."""

    starts: list[int]  # per sequence: tokens already in the KV cache
    token_ids: list[list[int]]  # per sequence: the tokens fed this step
    block_tables: list[list[int]]  # per sequence: its KV blocks
    logit_rows: list[list[int]]  # per sequence: offsets into its fed tokens that need logits
    # (flat positions among fed tokens, device ids) replacing token_ids' placeholders there
    on_device: tuple[list[int], torch.Tensor] | None = None

    @classmethod
    def from_batch(
        cls,
        batch: ScheduledBatch,
        logit_rows: list[list[int]],
        token_ids: list[list[int]] | None = None,
        on_device: tuple[list[int], torch.Tensor] | None = None,
    ) -> "StepInputs":
        """`token_ids[i]` overrides the tokens fed for sequence i (draft tokens)."""
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        if token_ids is None:
            token_ids = [
                seq.token_ids[s : s + n]
                for seq, s, n in zip(batch.seqs, starts, batch.num_new_tokens)
            ]
        for fed, n in zip(token_ids, batch.num_new_tokens):
            assert len(fed) == n
        return cls(
            starts, list(token_ids), [seq.block_table for seq in batch.seqs], logit_rows, on_device
        )

    def on_host(self) -> "StepInputs":
        """The same step with every fed token in token_ids (one host read of device-held ones)."""
        if self.on_device is None:
            return self
        flat = [t for fed in self.token_ids for t in fed]
        at, values = self.on_device
        for position, token in zip(at, values.tolist()):
            flat[position] = token
        token_ids, start = [], 0
        for fed in self.token_ids:
            token_ids.append(flat[start : start + len(fed)])
            start += len(fed)
        return replace(self, token_ids=token_ids, on_device=None)
