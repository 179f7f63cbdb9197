"""Build the SD draft (colocated) or start the SSD draft process: load it, check it shares the target's tokenizer, size its KV like the target's."""

import filecmp
import os
from dataclasses import dataclass, replace

import torch
from transformers import AutoTokenizer

from ssd_engine.core.config import EngineConfig
from ssd_engine.core.config_sections import ModelConfig
from ssd_engine.core.streams import Stream, stream_generator
from ssd_engine.models.loader import load_config
from ssd_engine.models.tokenizer_source import has_tokenizer_files
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.saguaro.plan import SaguaroPlan
from ssd_engine.speculative import prompt_window
from ssd_engine.speculative.sd import SyncDraft
from ssd_engine.speculative.ssd.coordinator import AsyncDraftClient
from ssd_engine.speculative.ssd.process import DraftSpec


@dataclass(frozen=True)
class TargetSide:
    """What building a draft needs from the engine that will verify it."""

    config: EngineConfig
    draft: ModelConfig  # the plan's: the draft's folder, device and decided formats
    saguaro: SaguaroPlan | None  # SSD: the plan's fan-outs and fallback rule
    model_path: str
    tokenizer: object
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    grammars: object


def check_same_tokenizer(target_tok, draft_tok, target_path: str, draft_path: str) -> None:
    if len(target_tok) != len(draft_tok) or target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            f"draft and target tokenizers differ: target {target_path} has {len(target_tok)} tokens, "
            f"draft {draft_path} has {len(draft_tok)}; speculative decoding needs the same vocabulary"
        )


def same_tokenizer_files(target_path: str, draft_path: str) -> bool:
    """True when both folders hold byte-identical tokenizer files: then the draft's tokenizer need
    not be loaded (and stay resident) to compare vocabularies."""
    names = ("tokenizer.json", "tokenizer_config.json")
    paths = [(os.path.join(target_path, n), os.path.join(draft_path, n)) for n in names]
    return all(
        os.path.isfile(a) and os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)
        for a, b in paths
    )


def draft_path_and_vocab(side: TargetSide) -> tuple[str, int]:
    """The draft's folder (checked against the target's tokenizer) and the ids it may propose:
    ids past the tokenizer (embedding padding) or past either model's vocabulary never are."""
    config = side.config
    draft_path, load_format = config.speculative.draft_model, config.model.load_format
    draft_config = load_config(draft_path, load_format)
    tokenizer_source = config.model.tokenizer or side.model_path
    # dummy models may lack tokenizers: the vocabulary sizes below still bound the proposals
    tokenizer_less = load_format == "dummy" and not (
        has_tokenizer_files(tokenizer_source) and has_tokenizer_files(draft_path)
    )
    if not tokenizer_less and not same_tokenizer_files(tokenizer_source, draft_path):
        check_same_tokenizer(
            side.tokenizer, AutoTokenizer.from_pretrained(draft_path), side.model_path, draft_path
        )
    k, budget = config.speculative.k, config.scheduler.max_num_batched_tokens
    if budget < k + 1:
        raise ValueError(
            f"max_num_batched_tokens={budget} cannot fit one verification of "
            f"num_speculative_tokens+1={k + 1} tokens"
        )
    return draft_path, min(len(side.tokenizer), draft_config.vocab_size, side.vocab_size)


def draft_host(choice: str, draft_device: str, target_device: str) -> str:
    """`ssd_draft_host` resolved: auto is a thread on the target's GPU (a second stream overlaps its
    kernels; two processes' contexts are time-sliced), else a process."""
    if choice != "auto":
        return choice
    draft, target = torch.device(draft_device), torch.device(target_device)
    shared_gpu = draft.type == target.type == "cuda" and (draft.index or 0) == (target.index or 0)
    return "thread" if shared_gpu else "process"


def start_async_draft(
    side: TargetSide, target: RunnerSpec, cores: list[int] | None, threads: int
) -> AsyncDraftClient:
    """Spawn the SSD draft on the plan's device (its own cores on CPU, the GPU after the target's
    ranks). Its KV cache and positions are sized like `target`'s."""
    _, vocab = draft_path_and_vocab(side)
    config, plan = side.config, side.saguaro
    runner = replace(target, model=side.draft)
    draft_spec = DraftSpec(
        runner,
        config,
        tuple((t, tuple(f)) for t, f in plan.fanouts),
        tuple((t, tuple(map(tuple, table))) for t, table in plan.fanout_tables),
        vocab,
        config.model.tokenizer or side.model_path,
        tuple(sorted(side.eos_token_ids)),
    )
    device = side.draft.device
    return AsyncDraftClient(
        draft_spec,
        side.vocab_size,
        cores,
        threads,
        config.speculative.draft_timeout_s,
        stream_generator(config.seed, Stream.BACKUP, "coordinator", device=side.device),
        side.device,
        plan,
        host=draft_host(config.speculative.ssd.draft_host, device, config.model.device),
        prompt_window=prompt_window.resolve(
            config.speculative.prompt_window, device, overlaps_target=True
        ),
    )


def build_sync_draft(side: TargetSide, target: RunnerSpec) -> SyncDraft:
    """SD's draft in this process, on the target's device and settings."""
    _, proposable = draft_path_and_vocab(side)
    k = side.config.speculative.k
    runner = replace(target, model=side.draft).build()
    # draft steps, and the catch-up: two tokens a row after a fully accepted round, else one
    runner.capture_graphs([("paged", 1), ("paged", 2)])
    window = prompt_window.resolve(
        side.config.speculative.prompt_window, target.model.device, overlaps_target=False
    )
    return SyncDraft(
        runner,
        target.cache.num_kv_blocks,
        target.cache.block_size,
        k,
        proposable,
        stream_generator(side.config.seed, Stream.DRAFT, device=side.device),
        side.grammars,
        reads_prompts_ahead=side.config.speculative.per_step == "off",
        prompt_window=window,
    )
