"""transformers' runners: `hf-ar` (model.generate) and `hf-assisted` (assisted generation with the
draft as `assistant_model`, K candidates a round, constant schedule, no confidence cut-off)."""

import time

from suite.measure import Request, batches, cell, own_peak_gb, pin


class FirstForward:
    """Time at which the target's first forward of a generate call returned: the first output token
    exists from then on (the prefill in `hf-ar`; the first verification in `hf-assisted`, which
    verifies the prompt and the first candidates in one forward)."""

    def __init__(self, model, sync) -> None:
        self.at, self.sync = None, sync
        model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if self.at is None:
            self.sync()
            self.at = time.perf_counter()


class AssistCounter:
    """Counts drafted / accepted candidates of assisted generation by wrapping
    `AssistedCandidateGenerator.update_candidate_strategy(input_ids, scores, num_matches)`, which
    every verification round calls with the scores of the candidates plus the bonus position."""

    def __init__(self) -> None:
        from transformers.generation.candidate_generator import AssistedCandidateGenerator

        self.rounds = self.drafted = self.accepted = 0
        original = AssistedCandidateGenerator.update_candidate_strategy
        counter = self

        def update_candidate_strategy(gen, input_ids, scores, num_matches):
            drafted = scores.shape[1] - 1
            if drafted > 0:  # rounds without candidates (length cap) are plain target steps
                counter.rounds += 1
                counter.drafted += drafted
                counter.accepted += int(num_matches)
            return original(gen, input_ids, scores, num_matches)

        AssistedCandidateGenerator.update_candidate_strategy = update_candidate_strategy

    def reset(self) -> None:
        self.rounds = self.drafted = self.accepted = 0

    def summary(self) -> dict:
        if not self.rounds:
            return {}
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted,
            "mean_acceptance_length": 1 + self.accepted / self.rounds,
        }


def _load(path: str, opts):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, opts.dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(opts.device).eval()


def _sync(opts):
    import torch

    return torch.cuda.synchronize if opts.device.startswith("cuda") else (lambda: None)


def measure(model, tok, first: FirstForward, opts, prompts: list[str], batch: int, **extra) -> dict:
    import torch

    sample = (
        dict(do_sample=True, temperature=opts.temperature, top_k=0)
        if opts.temperature > 0
        else dict(do_sample=False)
    )
    timed, started = [], time.perf_counter()
    for b, group in enumerate(batches(prompts, batch)):
        enc = tok(group, return_tensors="pt", padding=True).to(opts.device)
        if opts.temperature > 0:
            torch.manual_seed(b)
        first.at = None
        begin = time.perf_counter()
        out = model.generate(
            **enc,
            max_new_tokens=opts.new_tokens,
            min_new_tokens=opts.new_tokens,
            pad_token_id=tok.pad_token_id,
            **sample,
            **extra,
        )
        _sync(opts)()
        end = time.perf_counter()
        new = out[:, enc["input_ids"].shape[1] :].tolist()
        timed.append([Request(first.at - begin, end - begin, len(ids), ids) for ids in new])
    return cell(timed, time.perf_counter() - started)


def _setup(opts):
    pin(opts.cores, opts.threads, opts.device)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(opts.model, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = _load(opts.model, opts)
    return tok, model, FirstForward(model, _sync(opts))


def run_hf_ar(opts, prompt_sets: dict, progress) -> dict:
    tok, model, first = _setup(opts)
    rows = []
    for batch in opts.batch:
        measure(
            model, tok, first, _short(opts), [next(iter(prompt_sets.values()))[0]], batch
        )  # warm-up
        for name, prompts in prompt_sets.items():
            progress("measuring", f"hf-ar b={batch} {name}")
            rows.append(
                {
                    "mode": "hf-ar",
                    "set": name,
                    "batch": batch,
                    "k": None,
                    **measure(model, tok, first, opts, prompts, batch),
                }
            )
            progress("done", f"hf-ar b={batch} {name}")
    return {"rows": rows, "costs": {}, "peaks": {"engine": own_peak_gb()}}


def run_hf_assisted(opts, prompt_sets: dict, progress) -> dict:
    """Batch 1 only: transformers' assisted generation supports nothing else (other batch sizes are
    reported as not measured)."""
    tok, model, first = _setup(opts)
    draft = _load(opts.draft, opts)
    counter = AssistCounter()
    rows = []
    for k in opts.k:
        # read from the assistant's generation config: exactly K candidates a round
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = (
            0.0  # no early stop, no threshold tuning
        )
        measure(
            model,
            tok,
            first,
            _short(opts),
            [next(iter(prompt_sets.values()))[0]],
            1,
            assistant_model=draft,
        )
        for name, prompts in prompt_sets.items():
            counter.reset()
            progress("measuring", f"hf-assisted K={k} b=1 {name}")
            row = {
                "mode": "hf-assisted",
                "set": name,
                "batch": 1,
                "k": k,
                **measure(model, tok, first, opts, prompts, 1, assistant_model=draft),
            }
            spec = counter.summary()
            if spec and spec["drafted"] > k * spec["rounds"]:
                raise RuntimeError(
                    f"K={k} not honoured: {spec['drafted']} candidates in {spec['rounds']} rounds"
                )
            rows.append({**row, **spec})
            progress("done", f"hf-assisted K={k} b=1 {name}")
    return {"rows": rows, "costs": {}, "peaks": {"engine": own_peak_gb()}}


def _short(opts):
    import copy

    short = copy.copy(opts)
    short.new_tokens = 8
    return short


RUNNERS = {"hf-ar": run_hf_ar, "hf-assisted": run_hf_assisted}
