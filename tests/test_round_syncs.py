"""The pieces of a round read nothing back from the device but the emitted tokens (issue 22).

Counted with the sync counter (tests/instrumentation/sync_count.py): tensors made with an explicit
`torch.device` stand for device tensors. Each piece is also checked to compute what it computed
when it decided things by reading its tensors: probability rows with the host's flags equal those
read from the parameter tensors; sampling and verification told which rows are random by the host
give the same tokens from the same uniforms, and rows that are not random draw nothing; draft
tokens fed from the device give the same forward inputs as the same tokens fed as lists. The
whole round (one read per AR step, SD round and SSD coordinator round, greedy and sampled) is
asserted in tests/test_gpu_proxies.py.
"""

import pytest
import torch
from instrumentation.sync_count import SyncCounter
from runners import tiny_runner

from ssd_engine import SamplingParams
from ssd_engine.runtime.model_runner import ModelRunner
from ssd_engine.runtime.step_inputs import StepInputs
from ssd_engine.sampling.processors import SamplingTensors, probs_from_logits
from ssd_engine.sampling.rejection import verify
from ssd_engine.sampling.sampler import sample

DEVICE = torch.device("cpu")  # a device object: what the counter takes for the accelerator
VOCAB = 12
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=VOCAB + 5),
]  # top-k past the vocabulary: off


def _syncs(counter: SyncCounter) -> dict:
    return {f"{kind} @ {site}": n for (kind, site), n in counter.counts.items()}


@pytest.mark.parametrize("rows", [[0], [1], [1, 5], [0, 1], list(range(len(PARAMS)))])
def test_probs_decide_their_branches_on_the_host(rows):
    params = [PARAMS[i] for i in rows]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(len(rows)))
    sampling = SamplingTensors.from_params(params, DEVICE)
    with torch.inference_mode(), SyncCounter() as syncs:
        probs = sampling.probs(logits.to(DEVICE))
        repeated = SamplingTensors.from_params(params, DEVICE, times=2).probs(
            logits.to(DEVICE).repeat_interleave(2, dim=0)
        )
    assert _syncs(syncs) == {}
    read = probs_from_logits(
        logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    )
    assert torch.equal(probs, read) and torch.equal(repeated, read.repeat_interleave(2, dim=0))


def _rows_with_one_hot(n: int, seed: int) -> torch.Tensor:
    probs = torch.softmax(torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)), -1)
    probs[0] = torch.nn.functional.one_hot(torch.tensor(4), VOCAB)  # a greedy row
    probs[1] = torch.nn.functional.one_hot(torch.tensor(7), VOCAB)  # T > 0, but one possible token
    return probs


def test_sampling_told_the_random_rows_reads_nothing_and_draws_once_per_random_row():
    probs = _rows_with_one_hot(4, seed=1)
    random_rows = [False, True, True, True]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(4)]
    with SyncCounter() as syncs:
        told = sample(probs.to(DEVICE), gens, random_rows=random_rows)
    assert _syncs(syncs) == {}
    assert told[:2].tolist() == [4, 7]
    fresh = [torch.Generator().manual_seed(10 + i) for i in range(4)]
    assert torch.equal(gens[0].get_state(), fresh[0].get_state())  # the greedy row drew nothing
    for gen, again in zip(gens[1:], fresh[1:]):  # each random row drew one uniform, one-hot or not
        torch.rand(1, generator=again, dtype=torch.float64)
        assert torch.equal(gen.get_state(), again.get_state())
    # rows with more than one possible token draw the same uniform either way: the same tokens
    read = sample(probs[2:], [torch.Generator().manual_seed(12), torch.Generator().manual_seed(13)])
    assert torch.equal(told[2:], read)


def test_verification_told_the_random_rows_reads_the_device_once():
    n, k = 5, 3
    gen = torch.Generator().manual_seed(2)
    target = torch.softmax(torch.randn(n, k + 1, VOCAB, generator=gen), -1)
    target[0] = torch.nn.functional.one_hot(target[0].argmax(-1), VOCAB).float()  # a greedy row
    q = torch.softmax(torch.randn(n, k, VOCAB, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, VOCAB), 1, generator=gen).view(n, k)
    num_draft = torch.tensor([3, 3, 2, 0, 3])  # a host tensor, as proposers make it
    random_rows = [False, True, True, True, True]
    seeds = [torch.Generator().manual_seed(20 + i) for i in range(n)]
    with SyncCounter() as syncs:
        told = verify(
            drafts.to(DEVICE),
            q.to(DEVICE),
            target.to(DEVICE),
            seeds,
            num_draft,
            random_rows=random_rows,
        )
        told.output_tokens
    assert list(_syncs(syncs).values()) == [
        1
    ]  # the result: drafts, accepted counts, bonus tokens at once
    assert torch.equal(seeds[0].get_state(), torch.Generator().manual_seed(20).get_state())
    read = verify(
        drafts, q, target, [torch.Generator().manual_seed(20 + i) for i in range(n)], num_draft
    )
    assert told.output_tokens == read.output_tokens
    assert torch.equal(told.num_accepted, read.num_accepted) and torch.equal(
        told.bonus_tokens, read.bonus_tokens
    )


@pytest.fixture(scope="module")
def runner(tiny_qwen2) -> ModelRunner:
    return tiny_runner(tiny_qwen2, num_kv_blocks=32, block_size=4, max_position=128, device=DEVICE)


def test_drafts_fed_from_the_device_give_the_same_inputs(runner):
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    fed = [[5, 9, 10, 11], [6], [7, 12, 13, 14]]  # two verifications of K = 3 around a plain decode
    plain = StepInputs([8, 5, 11], fed, tables, [[0, 1, 2, 3], [0], [0, 1, 2, 3]])
    drafts = torch.tensor([[9, 10, 11], [12, 13, 14]], device=DEVICE)
    held = StepInputs(
        [8, 5, 11],
        [[5, 0, 0, 0], [6], [7, 0, 0, 0]],
        tables,
        plain.logit_rows,
        on_device=([1, 2, 3, 6, 7, 8], drafts.reshape(-1)),
    )
    assert held.on_host() == plain
    one_step = StepInputs(
        [12, 13], [[0], [0]], tables[:2], [[0], [0]], on_device=([0, 1], drafts[:, 0])
    )
    with torch.inference_mode(), SyncCounter() as syncs:
        prepared = [runner.prepare(held), runner.prepare(one_step)]
    assert _syncs(syncs) == {}
    for (ids, positions, meta), want in zip(prepared, [plain, one_step.on_host()]):
        want_ids, want_positions, want_meta = runner.prepare(want)
        assert torch.equal(ids, want_ids) and torch.equal(positions, want_positions)
        assert torch.equal(meta.slot_mapping, want_meta.slot_mapping)
    assert prepared[1][0].tolist() == [9, 12]


class _Uploads(torch.overrides.TorchFunctionMode):
    """Tensors made from host values (`torch.tensor`; `torch.frombuffer`, which torch modes do not see,
    by a wrapper), and moves of those onto the device object."""

    def __init__(self) -> None:
        super().__init__()
        self.made, self.moved = [], 0

    def __enter__(self):
        self._frombuffer = torch.frombuffer
        torch.frombuffer = lambda *args, **kwargs: self._made(self._frombuffer(*args, **kwargs))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.frombuffer = self._frombuffer
        return super().__exit__(*exc)

    def _made(self, tensor: torch.Tensor) -> torch.Tensor:
        self.made.append(tensor)
        return tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.tensor:
            self.made.append(out)
        if (
            func is torch.Tensor.to
            and any(args[0] is t for t in self.made)
            and any(isinstance(a, torch.device) for a in (*args[1:], *kwargs.values()))
        ):
            self.moved += 1
        return out


def test_a_steps_host_values_cross_in_one_copy(tiny_qwen2):
    """ids, positions, slots, key counts, query offsets, block tables, the device-held tokens' places
    and the logit rows: one tensor from the host and one move (on CUDA pinned and non-blocking: a
    copy from pageable memory would first wait for the stream to drain, utils/host_upload.py)."""
    runner = tiny_runner(tiny_qwen2, num_kv_blocks=16, block_size=4, max_position=64, device=DEVICE)
    tables = [[0, 1, 2], [3, 4, 5]]
    runner.run(StepInputs([0, 0], [[5, 6, 7], [8, 9]], tables, [[2], [1]]))
    drafts = torch.tensor([11, 12], device=DEVICE)
    step = StepInputs(
        [3, 2], [[7, 0, 0], [9, 0, 0]], tables, [[0, 1, 2], [2]], on_device=([1, 4], drafts)
    )
    with torch.inference_mode(), _Uploads() as uploads:
        logits = runner.run(step)
    assert (len(uploads.made), uploads.moved) == (1, 1)
    plain = runner.run(StepInputs([3, 2], [[7, 11, 0], [9, 12, 0]], tables, [[0, 1, 2], [2]]))
    assert torch.equal(logits, plain)  # the device-held tokens landed where the lists put them


def test_a_prefill_ending_beside_speculating_sequences_reads_once():
    """Sequence 0 finishes its prefill (one sampled token), 1 and 2 verify K = 2 drafts: the sampled
    token and the verification come back in one transfer, equal to reading them apart."""
    from ssd_engine.core.structures import Proposal, Sequence
    from ssd_engine.sampling.verifier import Verifier

    k, gen = 2, torch.Generator().manual_seed(3)
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=2),
    ]
    logits = torch.randn(1 + 2 * (k + 1), VOCAB, generator=gen)
    q = torch.softmax(torch.randn(2, k, VOCAB, generator=gen), -1)
    drafts = torch.multinomial(q.view(-1, VOCAB), 1, generator=gen).view(2, k)
    logit_rows, speculated = [[4], [0, 1, 2], [0, 1, 2]], [False, True, True]

    def step(device, counter):
        seqs = [Sequence([3, 4, 5], p, 4) for p in params]
        proposal = Proposal(drafts.to(device), q.to(device), torch.tensor([k, k]))
        with counter:
            results = Verifier(torch.Generator().manual_seed(0)).sample_or_verify(
                seqs, logit_rows, logits.to(device), speculated, proposal
            )
        return [(r.tokens, r.accepted) for r in results]

    syncs = SyncCounter()
    together = step(DEVICE, syncs)
    assert sum(syncs.counts.values()) == 1, _syncs(syncs)
    assert len(together[0][0]) == 1 and all(len(tokens) >= 1 for tokens, _ in together[1:])
    assert together == step("cpu", torch.inference_mode())  # plain host tensors: the same tokens
