"""The SSD draft's main loop: load the draft, then each round receive the request, apply the
outcomes, reply (cache hit or fallback), and build the next cache while the target verifies."""

import gc
import os
import sys
from dataclasses import replace

import torch

from ssd_engine.distributed import supervise
from ssd_engine.speculative.ssd.codec import ReplyLayout, decode_request, encode_reply
from ssd_engine.speculative.ssd.draft.server import DraftServer, new_server, scratch_slots
from ssd_engine.speculative.ssd.link import DraftEnd, DraftLink, DraftLinkError
from ssd_engine.speculative.ssd.process import READY_KEY, DraftSpec
from ssd_engine.speculative.ssd.protocol import Kind, Reply
from ssd_engine.speculative.ssd.reply_window import ReplyWindow


def draft_main(
    port: int,
    cores: list[int] | None,
    threads: int,
    timeout_s: float,
    draft_args: dict,
    reply_fd: int | None = None,
    reply_capacity: int = 0,
) -> None:
    draft_spec = DraftSpec.from_args(draft_args)
    device = draft_spec.runner.model.device
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    store = supervise.join_store(port, 2, supervise.STARTUP_TIMEOUT_S)
    server = build_server(draft_spec)
    gc.freeze()  # the process's built heap is permanent: full collections walk only the rounds' objects
    supervise.announce_ready(store, READY_KEY)
    window = None if reply_fd is None else ReplyWindow(reply_fd, reply_capacity)
    link = DraftLink(store, 1, timeout_s, payload_device=torch.device(device), reply_window=window)
    try:
        serve(link, server, draft_spec)
    except DraftLinkError:
        # the coordinator went away without a shutdown: its own error says why
        print(f"SSD draft {os.getpid()}: the coordinator closed the link, exiting", file=sys.stderr)
        raise SystemExit(1) from None


def build_server(draft_spec: DraftSpec) -> DraftServer:
    """The draft's model (with its scratch blocks and graphs) behind a server, ready for rounds."""
    cache, k, seqs = draft_spec.runner.cache, draft_spec.k, draft_spec.config.scheduler.max_num_seqs
    fanouts = [(t, list(f)) for t, f in draft_spec.fanouts]
    scratch_blocks = -(-scratch_slots(fanouts, k, seqs) // cache.block_size)
    runner_spec = replace(
        draft_spec.runner, cache=replace(cache, num_kv_blocks=cache.num_kv_blocks + scratch_blocks)
    )
    runner = runner_spec.build()
    server = new_server(draft_spec, runner)
    # just-in-time draft steps, a glue that cannot reuse a hit's path, branch steps
    runner.capture_graphs([("paged", 1), ("paged", k + 1), ("tree", k)])
    return server


def serve(link: DraftEnd, server: DraftServer, draft_spec: DraftSpec) -> None:
    """Answer the coordinator's rounds until it says shutdown."""
    out = torch.zeros(0, dtype=torch.uint8)
    while True:
        request = decode_request(link.recv_request())
        if request.kind == Kind.SHUTDOWN:
            return
        server.apply(request)
        wanted = request.wanted_ids
        if wanted:
            reply = Reply(server.timings(), server.lookup(wanted, request.backup))
            layout = ReplyLayout.of(request, draft_spec.k, draft_spec.vocab)
            shared = link.reply_buffer(layout)
            encoded = encode_reply(reply, layout, out=out if shared is None else shared)
            if shared is None and encoded.numel() > out.numel():
                out = encoded
            link.send_reply(encoded)
        server.build(wanted)
