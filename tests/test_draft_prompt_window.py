"""draft_prompt_window: a draft reads a long prompt's first SINK tokens and its last N only. Its
context never changes the output: greedy SD and SSD equal transformers' tokens with a window far
shorter than the prompts (SD's read in chunks, so the draft follows the target across the skipped
span; SSD's sent windowed to its draft process, also after preemption), and at T = 1 SD's (t1, t2)
fit the target's exact law (tests/test_distribution.py's method and bound)."""

from exact_law import output_law
from small_pair import DIST_PROMPT, sample_outputs
from stats_helpers import check_law
from test_speculative_decoding import GREEDY, _prompts, greedy_oracle, noisy_draft, target  # noqa: F401 (fixtures)

from ssd_engine import LLM, SamplingParams
from ssd_engine.core.structures import Sequence
from ssd_engine.speculative.prompt_window import SINK
from ssd_engine.speculative.sd import DraftView
from ssd_engine.speculative.ssd.coordinator import AsyncDraftClient


def test_a_view_maps_draft_positions_past_the_skipped_span():
    seq = Sequence(list(range(100, 130)), SamplingParams(), block_size=8)  # a 30-token prompt
    view = DraftView(seq, window=10)
    assert view.skipped == 30 - SINK - 10 and len(view) == SINK + 10
    assert view.feed(0, len(view)) == list(range(100, 100 + SINK)) + list(range(120, 130))
    assert view.feed(2, 7) == [102, 103, 120, 121, 122]
    assert [view.draft_length(n) for n in (3, SINK, 10, 20, 30)] == [
        3,
        SINK,
        SINK,
        SINK + 0,
        SINK + 10,
    ]
    seq.token_ids.append(7)  # an output token: one more draft position
    assert len(view) == SINK + 11 and view.feed(len(view) - 1, len(view)) == [7]
    assert DraftView(seq, window=None).skipped == 0 and DraftView(seq, window=40).skipped == 0


def test_ssd_sends_its_draft_a_windowed_prompt_and_whole_outputs():
    client = AsyncDraftClient.__new__(
        AsyncDraftClient
    )  # the entry-making part only: no draft process
    client.prompt_window, client.known, client.last_accepted, client.finished, client.source = (
        10,
        {},
        {},
        [],
        {},
    )
    seq = Sequence(list(range(100, 130)), SamplingParams(), block_size=8)  # a 30-token prompt
    first = client._news(seq)
    assert first.tokens == list(range(100, 100 + SINK)) + list(range(120, 130))
    assert first.params.num_prompt_tokens == SINK + 10
    seq.token_ids.extend([7, 8])
    assert client._news(seq).tokens == [7, 8]
    client.release(seq)  # preempted: relearnt with its outputs, the prompt windowed again
    assert client._news(seq).tokens == first.tokens + [7, 8]


def test_greedy_ssd_with_a_short_prompt_window_matches_transformers(target, noisy_draft):
    """Few KV blocks: sequences are preempted and the draft process learns them again."""
    with LLM(
        target,
        draft_model=noisy_draft,
        speculative_mode="ssd",
        num_speculative_tokens=3,
        num_threads=1,
        block_size=8,
        num_kv_blocks=14,
        ssd_fanout=1,
        draft_prompt_window=6,
    ) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        metrics = llm.speculation_metrics()
        assert llm.engine.execution()["draft_reads"] == f"a prompt's first {SINK} and last 6 tokens"
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == greedy_oracle(target)
    assert metrics["draft_failures"] == [] and 0 < metrics["acceptance_rate"] < 1


def test_greedy_sd_with_a_short_prompt_window_matches_transformers(target, noisy_draft):
    with LLM(
        target,
        draft_model=noisy_draft,
        speculative_mode="sd",
        num_speculative_tokens=3,
        num_threads=1,
        block_size=4,
        max_num_batched_tokens=16,
        draft_prompt_window=6,
    ) as llm:
        outputs = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
        acceptance = llm.speculation_metrics()["acceptance_rate"]
        assert llm.engine.execution()["draft_reads"] == f"a prompt's first {SINK} and last 6 tokens"
    assert [o.token_ids for o in outputs] == greedy_oracle(target)
    assert 0 < acceptance < 1


def test_sd_law_holds_with_a_prompt_window(small_pair):
    """A window of 0: the draft reads DIST_PROMPT's first SINK tokens and none after them."""
    target, _ = small_pair
    params = dict(temperature=1.0, ignore_eos=True)
    law = output_law(target, DIST_PROMPT, SamplingParams(max_tokens=2, **params), 2)
    sample, metrics = sample_outputs(
        small_pair, "sd", 22_000, 2, params, num_speculative_tokens=2, draft_prompt_window=0
    )
    check_law("SD, draft prompt window 0", sample, law, metrics, 0.02, 1e-3, 0.8, (0.2, 0.9))
