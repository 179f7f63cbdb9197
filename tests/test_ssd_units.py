"""SSD building blocks without the engine: the round's messages and their codec, tree masks, branch decoding against
transformers, the fast backup, mixed one-hot verification, the draft channel's overflow and deadline."""

import datetime
import threading
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from runners import tiny_runner
from transformers import AutoModelForCausalLM

from ssd_engine.core.config import EngineConfig
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.saguaro.source import Source
from ssd_engine.sampling.rejection import verify
from ssd_engine.speculative.ngram import fast_proposal, ngram_proposal
from ssd_engine.speculative.ssd.codec import (
    ReplyLayout,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    q_slots,
    request_size,
)
from ssd_engine.speculative.ssd.draft.server import new_server, scratch_slots
from ssd_engine.speculative.ssd.draft.tree_mask import branch_metadata
from ssd_engine.speculative.ssd.link import REQUEST_CAPACITY, DraftLink, DraftLinkError
from ssd_engine.speculative.ssd.process import DraftSpec
from ssd_engine.speculative.ssd.protocol import (
    DraftParams,
    DraftTimings,
    Entry,
    Kind,
    QMode,
    Reply,
    Request,
    Speculation,
    Wanted,
    q_width,
)

# --------------------------------------------------------------------------- messages


def test_request_round_trip_with_new_sequences_and_overflow():
    params = DraftParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=1234)
    long_prompt = list(
        range(3, 3 + REQUEST_CAPACITY // 8 + 100)
    )  # longer than the link's preallocated buffer
    req = Request(
        finished=[4, 9],
        entries=[Entry(7, -1, long_prompt, params), Entry(8, 2, [11, 12, 13])],
        wanted=[Wanted(8, 0), Wanted(7, 80)],
        backup=Source.FAST,
        window_s=0.3125,
    )
    frame = encode_request(req)
    assert (
        frame.dtype == torch.uint8
        and frame.numel() > REQUEST_CAPACITY
        and request_size(frame) == frame.numel()
    )
    back = decode_request(frame)
    assert back.kind == Kind.ROUND and back.finished == [4, 9] and back.backup == Source.FAST
    assert back.window_s == 0.3125  # exact in float32
    assert back.wanted == req.wanted and back.wanted_ids == [8, 7]
    assert (
        back.entries[0].tokens == long_prompt
        and back.entries[1].accepted == 2
        and back.entries[1].params is None
    )
    got = back.entries[0].params
    assert (got.top_k, got.seed) == (40, 1234)
    # sampling parameters travel as float32, the values the draft samples with
    for name in ("temperature", "top_p", "min_p"):
        assert got.__dict__[name] == torch.tensor(getattr(params, name), dtype=torch.float32).item()
    # the reply's layout follows from the request alone: both ends compute the same one
    assert ReplyLayout.of(back, 4, 80) == ReplyLayout.of(req, 4, 80) == ReplyLayout(4, (0, 80), 80)
    assert decode_request(encode_request(Request(kind=Kind.SHUTDOWN))).kind == Kind.SHUTDOWN


def _row(vocab, support, gen):
    q = torch.zeros(vocab)
    ids = torch.randperm(vocab, generator=gen)[:support]
    q[ids] = torch.rand(support, generator=gen) + 0.1
    return q / q.sum()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_reply_round_trip_every_q_mode(device):
    """On a GPU the draft's rows sit on its device: they cross in one read (supports) and
    non-blocking copies into a pinned buffer (whole rows), which must still land bit for bit; a
    reply encoded into a GPU buffer (the payload of a link between GPUs, or a draft thread's) keeps
    its whole rows there and crosses to the host only up to `wide_at`."""
    vocab, k = 50, 3
    gen = torch.Generator().manual_seed(0)
    full = torch.stack([_row(vocab, vocab, gen) for _ in range(k)])
    compact = torch.stack([_row(vocab, s, gen) for s in (4, 2, 1)])
    tied = torch.stack(
        [_row(vocab, s, gen) for s in (4, 5, 3)]
    )  # one row has more than top_k = 4 tokens
    params = [
        DraftParams(1.0),
        DraftParams(0.8, top_k=4),
        DraftParams(0.8, top_k=4),
        DraftParams(0.0),
        DraftParams(1.0),
        DraftParams(1.0, top_k=4),
    ]
    on = torch.device(device)
    specs = [
        Speculation(Source.HIT, [1, 2, 3], full.to(on), bonus_rank=0),
        Speculation(Source.JIT, [4, 5, 6], compact.to(on), bonus_rank=32),
        Speculation(Source.HIT, [7, 8, 9], tied.to(on)),
        Speculation(Source.HIT, [10, 11, 12]),
        Speculation(Source.FAST, [13, 14, 15]),
        Speculation(Source.NONE, []),
    ]
    widths = [q_width(p, vocab) for p in params]
    assert widths == [vocab, 8, 8, 0, vocab, 8]
    assert [m for m, _ in q_slots(specs, tuple(widths), vocab)] == [QMode.FULL, QMode.COMPACT] + [
        QMode.ONE_HOT
    ] * 4
    layout = ReplyLayout(k, tuple(widths), vocab)
    # narrow slots first, in wanted order, then the wide ones: the host part ends where they begin
    slot = 4 * k
    narrow_end = layout.q_at + slot * 8 * 3
    assert layout.wide_at == narrow_end and layout.size == narrow_end + slot * vocab * 2
    assert layout.slots_at == (
        narrow_end,
        layout.q_at,
        layout.q_at + slot * 8,
        layout.q_at + slot * 16,
        narrow_end + slot * vocab,
        layout.q_at + slot * 16,
    )
    timings = DraftTimings(0.25, 0.5, 0.125, 1 / 3, 12)
    host = encode_reply(
        Reply(timings, specs), layout, out=torch.full((layout.size + 10,), 7, dtype=torch.uint8)
    )
    assert host.dtype == torch.uint8 and host.numel() == layout.size and host.device.type == "cpu"
    assert torch.equal(
        encode_reply(Reply(timings, specs), layout), host
    )  # a buffer of its own (pinned on a GPU)
    on_device = encode_reply(
        Reply(timings, specs),
        layout,
        out=torch.full((layout.size,), 7, dtype=torch.uint8, device=on),
    )
    assert on_device.device.type == on.type and torch.equal(on_device.cpu(), host)
    for buf in (host.clone(), on_device):
        back = decode_reply(buf, layout)
        assert back.timings == timings  # float64: the draft's timings arrive exactly
        assert [s.bonus_rank for s in back.speculations] == [0, 32, -1, -1, -1, -1]
        assert [s.source for s in back.speculations] == [s.source for s in specs]
        assert [s.tokens for s in back.speculations] == [s.tokens for s in specs]
        whole = back.speculations[0].q
        assert (
            whole.device == buf.device and whole.data_ptr() == buf.data_ptr() + layout.slots_at[0]
        )  # not copied
        assert torch.equal(whole.cpu(), full) and torch.equal(
            back.speculations[1].q.dense(vocab), compact
        )  # bit-exact
        assert all(s.q is None for s in back.speculations[2:])  # verified as one-hot: still exact
    # the host reads nothing past wide_at: garbage there changes only the whole rows
    spoiled = host.clone()
    spoiled[layout.wide_at :] = 255
    back = decode_reply(spoiled, layout)
    assert back.timings == timings and [s.tokens for s in back.speculations] == [
        s.tokens for s in specs
    ]
    assert torch.equal(back.speculations[1].q.dense(vocab), compact) and not torch.equal(
        back.speculations[0].q, full
    )
    with pytest.raises(ValueError, match="2 tokens"):
        encode_reply(
            Reply(timings, [Speculation(Source.FAST, [1, 2])]), ReplyLayout(k, (0,), vocab)
        )


# --------------------------------------------------------------------------- tree mask


def test_branch_metadata_dense_view_sees_its_trunk_prefix_and_own_path_only():
    tables = torch.tensor([[0, 1]], dtype=torch.int32)  # one sequence, blocks 0 and 1 of 4 slots
    visible = torch.tensor([2, 5, 0])
    scratch = torch.tensor([[20, 21, 22], [23, 24, 25], [26, 27, 28]])
    meta = branch_metadata(
        tables, torch.tensor([0, 0, 0]), visible, 6, scratch, step=1, block_size=4
    )
    dense = meta.dense()
    mask = dense.mask[:, 0]
    assert mask.shape == (3, 9)
    assert dense.gather_slots[1].tolist() == [0, 1, 2, 3, 4, 5, 23, 24, 25]
    assert mask[0].tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 0]
    assert mask[1].tolist() == [1, 1, 1, 1, 1, 0, 1, 1, 0]
    assert mask[2].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 0]


def test_branch_metadata_never_reaches_a_sibling():
    tables = torch.tensor([[0, 1], [4, 0]], dtype=torch.int32)  # blocks of 4 slots
    trunk_slots = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [16, 17, 18, 19, 0, 0, 0, 0]])
    seq_of_branch = torch.tensor([0, 0, 1, 1])
    visible = torch.tensor([3, 5, 2, 3])
    k = 4
    scratch = (100 + torch.arange(4 * k)).view(4, k)
    for step in range(k):
        meta = branch_metadata(tables, seq_of_branch, visible, 5, scratch, step, block_size=4)
        assert torch.equal(meta.slot_mapping, scratch[:, step])
        dense = meta.dense()
        for r in range(4):
            seen = set(dense.gather_slots[r][dense.mask[r, 0]].tolist())
            trunk = set(trunk_slots[seq_of_branch[r], : visible[r]].tolist())
            path = set(scratch[r, : step + 1].tolist())
            assert seen == trunk | path  # every branch sees its trunk prefix and its own path ...
            others = set(scratch.flatten().tolist()) - set(scratch[r].tolist())
            assert not seen & others  # ... and never a sibling's


@pytest.fixture(scope="module")
def nopad(tiny_model_dir) -> str:
    return tiny_model_dir("qwen2", vocab_size=259)


def _server(path: str, fanout: list[int], k: int, fit_window: bool = False):
    fanouts = [(0.0, fanout)]
    runner = tiny_runner(
        path,
        num_kv_blocks=32 + -(-scratch_slots(fanouts, k, 2) // 8),
        block_size=8,
        max_position=128,
    )
    config = EngineConfig.from_kwargs(
        speculative_mode="ssd",
        num_speculative_tokens=k,
        ssd_fit_window=fit_window,
        block_size=8,
        max_num_seqs=2,
    )
    draft_spec = DraftSpec(
        RunnerSpec(config.model, replace(config.cache, num_kv_blocks=32), 128),
        config,
        ((0.0, tuple(fanout)),),
        (),
        vocab=259,
    )
    return new_server(draft_spec, runner)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_cached_branch_equals_decoding_its_context_with_transformers(nopad, temperature):
    """Each branch (k, t*) decoded in the batched tree must be what decoding committed + x[:k] + t*
    alone gives: greedy tokens equal HF's argmax; sampled rows equal HF's softmax at every step."""
    k, fanout = 3, [2, 1, 2, 3]
    server = _server(nopad, fanout, k)
    hf = AutoModelForCausalLM.from_pretrained(nopad, dtype=torch.float32).eval()
    prompts = {0: [5, 9, 14, 3, 77, 120, 8, 8, 31], 1: [200, 17, 4, 66]}
    params = DraftParams(temperature=temperature)
    server.apply(Request(entries=[Entry(i, -1, p, params) for i, p in prompts.items()]))
    server.build([])
    server.apply(Request(entries=[Entry(i, -1, [40 + i]) for i in prompts]))
    sent = server.lookup([0, 1])
    server.build([0, 1])
    for seq_id, spec in zip((0, 1), sent):
        seq = server.seqs[seq_id]
        assert spec.source == Source.JIT and len(seq.cache) == sum(fanout)
        assert {key[0] for key in seq.cache} == {0, 1, 2, 3}
        for (accepted, bonus), branch in seq.cache.items():
            if accepted < k:
                assert bonus != spec.tokens[accepted]  # a rejected token is never a bonus candidate
            context = seq.tokens + spec.tokens[:accepted] + [bonus]
            ids = torch.tensor([context + branch.tokens[:-1]])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(context) - 1 :, :259]
            if temperature == 0:
                assert branch.q is None and branch.tokens == logits.argmax(-1).tolist()
            else:
                expected = torch.softmax(logits / temperature, dim=-1)
                assert torch.allclose(branch.q, expected, atol=1e-5)
                assert all(branch.q[i, t] > 0 for i, t in enumerate(branch.tokens))


def test_a_hit_replies_with_the_cached_branch(nopad):
    k = 2
    server = _server(nopad, [1, 1, 1], k)
    server.apply(Request(entries=[Entry(0, -1, [5, 6, 7, 8], DraftParams())]))
    server.build([])
    server.apply(Request(entries=[Entry(0, -1, [9])]))
    first = server.lookup([0])[0]
    server.build([0])
    cached = dict(server.seqs[0].cache)
    ((outcome, branch),) = [(key, b) for key, b in cached.items() if key[0] == 1]
    # the target accepted one draft token and chose the predicted bonus: a hit
    server.apply(Request(entries=[Entry(0, 1, first.tokens[:1] + [outcome[1]])]))
    second = server.lookup([0])[0]
    assert second.source == Source.HIT and second.tokens == branch.tokens
    # an outcome nobody predicted misses and falls back to the just-in-time primary
    server.build([0])
    server.apply(Request(entries=[Entry(0, 0, [258])]))
    assert server.lookup([0])[0].source == Source.JIT


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_just_in_time_draft_reads_the_device_once(nopad, temperature):
    """Each draft token is fed to the next step from the device; the K drafts come back in one read,
    and the trunk then holds them: what drafting the same tokens one by one from lists would hold."""
    from instrumentation.sync_count import SyncCounter

    k = 3
    server = _server(nopad, [1, 1, 1, 1], k)
    server.apply(
        Request(entries=[Entry(0, -1, [5, 6, 7, 8], DraftParams(temperature=temperature))])
    )
    server.build([])
    server.apply(Request(entries=[Entry(0, -1, [9])]))
    with SyncCounter() as syncs:
        spec = server.lookup([0])[0]
    assert spec.source == Source.JIT and sum(syncs.counts.values()) == 1, dict(syncs.counts)
    assert server.seqs[0].trunk == [5, 6, 7, 8, 9] + spec.tokens[: k - 1]
    if temperature == 0:
        hf = AutoModelForCausalLM.from_pretrained(nopad, dtype=torch.float32).eval()
        with torch.no_grad():
            want = hf.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=k, do_sample=False)[
                0, 5:
            ]
        assert spec.tokens == want.tolist()


def _hit_then_build(path: str, reuse: bool):
    """A hit on the k = 1 branch, then the next build: with `reuse` its path's K/V and step logits
    stand in for the glue, else the glue recomputes them."""
    k = 3
    server = _server(path, [1, 1, 1, 1], k)
    server.apply(Request(entries=[Entry(0, -1, [5, 6, 7, 8, 9, 10, 11, 12, 13], DraftParams())]))
    server.build([])
    server.apply(Request(entries=[Entry(0, -1, [14])]))
    first = server.lookup([0])[0]
    server.build([0])
    ((outcome, _),) = [(key, b) for key, b in server.seqs[0].cache.items() if key[0] == 1]
    server.apply(Request(entries=[Entry(0, 1, first.tokens[:1] + [outcome[1]])]))
    second = server.lookup([0])[0]
    assert second.source == Source.HIT
    if not reuse:
        server.builder.paths = {}  # as if another build had overwritten the scratch paths
    server.build([0])
    seq = server.seqs[0]
    slots = [seq.block_table[p // 8] * 8 + p % 8 for p in range(len(seq) - 1, len(seq) + k)]
    return server, seq, server.trunk.runner.kv_cache[:, :, slots].clone()


def test_a_hit_reuses_its_branch_path_instead_of_recomputing_the_glue(nopad):
    reused_server, reused, kv_reused = _hit_then_build(nopad, reuse=True)
    glued_server, glued, kv_glued = _hit_then_build(nopad, reuse=False)
    assert (
        reused_server.builder.glue_rows == 1 and glued_server.builder.glue_rows == 4
    )  # K + 1 rows
    assert reused.trunk == glued.trunk and reused.sent.tokens == glued.sent.tokens
    # the copied path's K/V (t*, x_1, x_2) and x_3's are what the glue computes, to fp32 rounding
    assert torch.allclose(kv_reused, kv_glued, atol=1e-5)
    assert [r[:5] for r in reused.ranked] == [r[:5] for r in glued.ranked]
    assert {key: spec.tokens for key, spec in reused.cache.items()} == {
        key: spec.tokens for key, spec in glued.cache.items()
    }


def test_a_build_that_outlasts_the_verification_shrinks_the_next_and_keeps_its_shape(nopad):
    """The coordinator reports a verification window far shorter than the build: the next build
    decodes fewer branches, the likeliest outcome's kept; a roomy window lets them grow back."""
    k, planned = 2, [1, 2, 4]
    server = _server(nopad, planned, k, fit_window=True)
    server.apply(Request(entries=[Entry(0, -1, [5, 6, 7, 8], DraftParams())]))
    server.build([])
    server.apply(Request(entries=[Entry(0, -1, [9])]))
    first = server.lookup([0])[0]
    server.build([0])
    assert server.builder.branch_rows == 7 and len(server.seqs[0].cache) == 7
    built = server.builder.seconds
    # the target verified for a third of the build: the branch rows that fit get kept
    server.apply(Request(entries=[Entry(0, 0, [first.tokens[0] ^ 1])], window_s=built / 3))
    assert server.budget.cap < 7
    server.lookup([0])
    server.build([0])
    shrunk = server.seqs[0].fanout
    assert server.builder.branch_rows == sum(shrunk) == server.budget.cap
    assert shrunk[2] >= max(shrunk[:2]) and server.seqs[0].planned_fanout == planned
    # verification far longer than any build: one row back per round up to the plan
    for _ in range(8):
        server.apply(Request(entries=[Entry(0, 0, [3])], window_s=100.0))
        server.lookup([0])
        server.build([0])
    assert server.budget.cap is None and server.seqs[0].fanout == planned


# --------------------------------------------------------------------------- fast backup


def test_ngram_proposes_what_followed_the_latest_match():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]
    assert ngram_proposal([5, 6, 5, 6], 3) == [
        5,
        6,
        6,
    ]  # short continuation padded with its last token
    assert ngram_proposal([1, 2, 3, 4], 3) is None
    gen = torch.Generator().manual_seed(0)
    tokens = fast_proposal([1, 2, 3, 4], 4, 10, gen)
    assert len(tokens) == 4 and all(0 <= t < 10 for t in tokens)


# --------------------------------------------------------------------------- mixed one-hot verification


def test_verify_one_hot_rows_equal_verifying_them_alone():
    """A batch mixing sampled drafts (q rows) with deterministic ones gives each row the outcome it
    gets alone: the q row of a one-hot row is ignored, its rule is accept w.p. p(x)."""
    gen = torch.Generator().manual_seed(3)
    n, k, vocab = 6, 3, 12
    target = torch.softmax(torch.randn(n, k + 1, vocab, generator=gen), -1)
    draft = torch.softmax(torch.randn(n, k, vocab, generator=gen), -1)
    tokens = torch.randint(0, vocab, (n, k), generator=gen)
    one_hot = torch.tensor([True, False, True, False, False, True])
    seeds = [torch.Generator().manual_seed(100 + i) for i in range(n)]
    mixed = verify(tokens, draft, target, seeds, one_hot_rows=one_hot)
    for i in range(n):
        alone = verify(
            tokens[i : i + 1],
            None if one_hot[i] else draft[i : i + 1],
            target[i : i + 1],
            [torch.Generator().manual_seed(100 + i)],
        )
        assert mixed.output_tokens[i] == alone.output_tokens[0]


# --------------------------------------------------------------------------- the channel


def test_link_carries_overflowing_requests_and_enforces_the_deadline():
    store = dist.HashStore()
    links = {}

    def make(rank):
        links[rank] = DraftLink(store, rank, timeout_s=1.0)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    coordinator, draft = links[0], links[1]
    req = encode_request(
        Request(
            entries=[Entry(1, -1, list(range(REQUEST_CAPACITY // 8 + 5)), DraftParams())],
            wanted=[Wanted(1, 0)],
        )
    )
    received = {}
    t = threading.Thread(target=lambda: received.update(words=draft.recv_request()))
    t.start()
    coordinator.send_request(req)
    t.join()
    assert torch.equal(received["words"][: req.numel()], req)
    t = threading.Thread(target=draft.send_reply, args=(torch.arange(6, dtype=torch.uint8),))
    t.start()
    assert coordinator.recv_reply(6).tolist() == list(range(6))
    t.join()
    coordinator.send_request(req[:8].clone())  # one-way: returns although nobody receives yet
    started = datetime.datetime.now()
    with pytest.raises(DraftLinkError, match="[Tt]imed out"):
        coordinator.recv_reply(6)  # the draft never answers
    assert (datetime.datetime.now() - started).total_seconds() < 10
