"""Build the SD draft (colocated) or start the SSD draft process: load it, check it shares the target's tokenizer, size its KV like the target's."""
import filecmp
import os
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from ssd_engine.core.config_parts import Config
from ssd_engine.core.streams import Stream, stream_generator
from ssd_engine.models.default_models import cache_dir
from ssd_engine.models.loader import load_config
from ssd_engine.models.tokenizer_source import has_tokenizer_files
from ssd_engine.runtime import draft_format
from ssd_engine.runtime.draft_format import DraftFormat
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.saguaro.plan import plan_saguaro
from ssd_engine.speculative import prompt_window
from ssd_engine.speculative.sd import SyncDraft
from ssd_engine.speculative.ssd.coordinator import AsyncDraftClient
from ssd_engine.speculative.ssd.process import DraftSpec


@dataclass(frozen=True)
class TargetSide:
    """What building a draft needs from the engine that will verify it."""
    parts: Config
    timing: tuple[float, float] | None      # auto's predicted (T_p, T_jit): seeds SSD's fallback rule
    model_path: str
    tokenizer: object
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    grammars: object


def check_same_tokenizer(target_tok, draft_tok, target_path: str, draft_path: str) -> None:
    if len(target_tok) != len(draft_tok) or target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"draft and target tokenizers differ: target {target_path} has {len(target_tok)} tokens, "
                         f"draft {draft_path} has {len(draft_tok)}; speculative decoding needs the same vocabulary")


def same_tokenizer_files(target_path: str, draft_path: str) -> bool:
    """True when both folders hold byte-identical tokenizer files: then the draft's tokenizer need
    not be loaded (and stay resident) to compare vocabularies."""
    names = ("tokenizer.json", "tokenizer_config.json")
    paths = [(os.path.join(target_path, n), os.path.join(draft_path, n)) for n in names]
    return all(os.path.isfile(a) and os.path.isfile(b) and filecmp.cmp(a, b, shallow=False) for a, b in paths)


def draft_path_and_vocab(side: TargetSide) -> tuple[str, int]:
    """The draft's folder (checked against the target's tokenizer) and the ids it may propose:
    ids past the tokenizer (embedding padding) or past either model's vocabulary never are."""
    parts = side.parts
    draft_path, load_format = parts.speculative.draft_model, parts.model.load_format
    draft_config = load_config(draft_path, load_format)
    tokenizer_source = parts.model.tokenizer or side.model_path
    # dummy models may lack tokenizers: the vocabulary sizes below still bound the proposals
    tokenizer_less = load_format == "dummy" and not (has_tokenizer_files(tokenizer_source)
                                                     and has_tokenizer_files(draft_path))
    if not tokenizer_less and not same_tokenizer_files(tokenizer_source, draft_path):
        check_same_tokenizer(side.tokenizer, AutoTokenizer.from_pretrained(draft_path), side.model_path, draft_path)
    k, budget = parts.speculative.k, parts.scheduler.max_num_batched_tokens
    if budget < k + 1:
        raise ValueError(f"max_num_batched_tokens={budget} cannot fit one verification of "
                         f"num_speculative_tokens+1={k + 1} tokens")
    return draft_path, min(len(side.tokenizer), draft_config.vocab_size, side.vocab_size)


def draft_host(choice: str, draft_device: str, target_device: str) -> str:
    """`ssd_draft_host` resolved: auto is a thread on the target's GPU (a second stream overlaps its
    kernels; two processes' contexts are time-sliced), else a process."""
    if choice != "auto":
        return choice
    draft, target = torch.device(draft_device), torch.device(target_device)
    shared_gpu = draft.type == target.type == "cuda" and (draft.index or 0) == (target.index or 0)
    return "thread" if shared_gpu else "process"


def start_async_draft(side: TargetSide, target: RunnerSpec, cores: list[int] | None,
                      threads: int) -> tuple[AsyncDraftClient, DraftFormat]:
    """Spawn the SSD draft: next GPU after the target's ranks, or its own cores on CPU. Its KV cache
    and positions are sized like `target`'s."""
    draft_path, vocab = draft_path_and_vocab(side)
    parts = side.parts
    device = parts.model.device
    if device.startswith("cuda"):
        first = torch.device(device).index or 0
        wanted = first + parts.parallel.tensor_parallel_size
        # too few GPUs: the draft shares the last one
        device = f"cuda:{wanted if wanted < torch.cuda.device_count() else torch.cuda.device_count() - 1}"
    plan = plan_saguaro(parts.speculative, side.model_path, draft_path, side.timing)
    k = parts.speculative.k
    branch_rows = max(sum(fanout) for _, fanout in plan.fanouts)
    # a round: the glue scores K+1 rows, then K branch steps of B rows; a miss drafts one row
    runner, chosen = with_draft_format(target.with_model(path=draft_path, device=device), parts.speculative.draft_dtype,
                                       [(1, 1), (k + 1, 1), (max(branch_rows, 1), k)], cores, threads)
    draft_spec = DraftSpec(runner, parts.speculative, tuple((t, tuple(f)) for t, f in plan.fanouts),
                           tuple((t, tuple(map(tuple, table))) for t, table in plan.fanout_tables),
                           vocab, parts.scheduler.max_num_seqs, parts.seed,
                           parts.model.tokenizer or side.model_path, tuple(sorted(side.eos_token_ids)))
    client = AsyncDraftClient(draft_spec, side.vocab_size, cores, threads, parts.speculative.draft_timeout_s,
                              stream_generator(parts.seed, Stream.BACKUP, "coordinator", device=side.device),
                              side.device, plan, host=draft_host(parts.speculative.ssd.draft_host, device, parts.model.device),
                              prompt_window=prompt_window.resolve(parts.speculative.prompt_window, device, overlaps_target=True))
    return client, chosen


def build_sync_draft(side: TargetSide, target: RunnerSpec) -> tuple[SyncDraft, DraftFormat]:
    """SD's draft in this process, on the target's device and settings."""
    draft_path, proposable = draft_path_and_vocab(side)
    k = side.parts.speculative.k
    runner_spec, chosen = with_draft_format(target.with_model(path=draft_path), side.parts.speculative.draft_dtype,
                                            [(1, k)], None, torch.get_num_threads())
    runner = runner_spec.build()
    # draft steps, and the catch-up: two tokens a row after a fully accepted round, else one
    runner.capture_graphs([("paged", 1), ("paged", 2)])
    window = prompt_window.resolve(side.parts.speculative.prompt_window, target.model.device, overlaps_target=False)
    return SyncDraft(runner, target.cache.num_kv_blocks, target.cache.block_size, k, proposable,
                     stream_generator(side.parts.seed, Stream.DRAFT, device=side.device), side.grammars,
                     reads_prompts_ahead=side.parts.speculative.per_step == "off", prompt_window=window), chosen


def with_draft_format(runner_spec: RunnerSpec, option: str, workload: list[tuple[int, int]],
                      cores: list[int] | None, threads: int) -> tuple[RunnerSpec, DraftFormat]:
    """The draft's runner spec in the weight format `option` resolves to, and that format."""
    chosen = draft_format.resolve(option, load_config(runner_spec.model.path, runner_spec.model.load_format), runner_spec.model.device, workload, cores, threads,
                                  cache_dir())
    # row_independent is the target's option alone
    return runner_spec.with_model(dtype=chosen.dtype, weight_format=chosen.name if runner_spec.model.device == "cpu" else None,
                                  row_independent=False), chosen
