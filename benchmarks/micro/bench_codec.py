"""Micro-benchmark (not a test): encode / decode of one SSD round's messages (speculative/ssd/codec.py).

    python benchmarks/micro/bench_codec.py                    # 64 sequences, K = 4, vocab 151936, 1 thread
    python benchmarks/micro/bench_codec.py --batch 8 --threads 2

Replies: every sequence greedy (no q rows), sampled with top_k = 40 (COMPACT rows) and sampled over
the whole vocabulary (FULL rows, ~155 MB at the defaults). Requests: one round's news for every
sequence (4 new tokens each), and every sequence new with a 2000-token prompt. Encode is the
draft's side of a reply (the coordinator's of a request), decode the other end's; for a reply,
"to proposal" is the coordinator's whole stretch from the received bytes to the verifier's dense
[batch, K, vocab] probabilities on the host (decode + speculative/ssd/proposal_rows.py). Milliseconds per
message, best of a few repeats of the mean over `n` calls (the machine may be shared). "host bytes
of a GPU reply": what crosses to the coordinator's host when the reply arrives on its GPU (NCCL from
the draft's GPU: the head before `ReplyLayout.wide_at`; whole rows stay on the GPU).
"""
import argparse
import time

import torch

from ssd_engine.saguaro.source import Source
from ssd_engine.speculative.ssd.codec import (
    ReplyLayout,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from ssd_engine.speculative.ssd.proposal_rows import proposal_probs
from ssd_engine.speculative.ssd.protocol import (
    DraftParams,
    DraftTimings,
    Entry,
    Reply,
    Request,
    Speculation,
    Wanted,
    q_width,
)


def _ms(call, n: int, repeats: int = 3) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e3


def _rows(batch: int, k: int, vocab: int, support: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, k, vocab] probability rows, each with `support` tokens above zero."""
    q = torch.zeros(batch, k, vocab)
    for i in range(batch):
        ids = torch.randperm(vocab, generator=gen)[:support]
        q[i][:, ids] = torch.rand(k, support, generator=gen) + 0.1
    return q / q.sum(-1, keepdim=True)


def bench_replies(batch: int, k: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    cases = (("greedy", DraftParams(0.0), 0), ("compact top_k=40", DraftParams(1.0, top_k=40), 40),
             ("full", DraftParams(1.0), vocab))
    for name, params, support in cases:
        q = _rows(batch, k, vocab, support, gen) if support else None
        specs = [Speculation(Source.HIT, list(range(k)), None if q is None else q[i], bonus_rank=0)
                 for i in range(batch)]
        request = Request(wanted=[Wanted(i, q_width(params, vocab)) for i in range(batch)])
        layout = ReplyLayout.of(request, k, vocab)
        reply = Reply(DraftTimings(0.1, 0.2, 0.3, 0.4, 5), specs)
        out = torch.empty(layout.size, dtype=torch.uint8)
        n = 3 if support == vocab else 20
        encode = _ms(lambda: encode_reply(reply, layout, out=out), n)
        decode = _ms(lambda: decode_reply(out, layout), n)
        host = torch.device("cpu")
        proposal = _ms(lambda: proposal_probs([s.q for s in decode_reply(out, layout).speculations], k, vocab, host), n)
        print(f"| reply {name} | {encode:.2f} | {decode:.2f} | {proposal:.2f} | {layout.size} | {layout.wide_at} |")


def bench_requests(batch: int) -> None:
    news = Request(finished=[1, 2], entries=[Entry(i, 3, [5, 6, 7, 8]) for i in range(batch)],
                   wanted=[Wanted(i, 0) for i in range(batch)])
    sampled = DraftParams(0.7, 40, 0.9, 0.0, 1)
    prompts = Request(entries=[Entry(i, -1, list(range(2000)), sampled) for i in range(batch)],
                      wanted=[Wanted(i, 80) for i in range(batch)])
    for name, request, n in (("request, news", news, 200), ("request, 2000-token prompts", prompts, 10)):
        frame = encode_request(request)
        encode = _ms(lambda: encode_request(request), n)
        decode = _ms(lambda: decode_request(frame), n)
        print(f"| {name} | {encode:.3f} | {decode:.3f} | | {frame.numel()} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, K = {args.k}, vocab {args.vocab}, {args.threads} thread(s)\n")
    print("| message | encode ms | decode ms | to proposal ms | bytes | host bytes of a GPU reply |\n"
          "|---|---|---|---|---|---|")
    bench_replies(args.batch, args.k, args.vocab)
    bench_requests(args.batch)


if __name__ == "__main__":
    main()
