"""The fp64 oracle of tests/test_bf16_exactness.py and the bound on a bf16 target's logit error.

`Fp64Reference` is transformers' model on the checkpoint's weights rounded to bf16 and held in
fp64: it computes the same function as the engine's bf16 target (same weights, bit for bit), only
without the engine's bf16 rounding of activations, KV cache and logits. transformers keeps a few
steps in fp32 even in an fp64 model (RMSNorm, the rotary tables, the softmax); their error, ~2^-24
relative, is 10^5 below bf16's and is ignored.

`logit_error_bound` is the first-order bound on that rounding (tests/test_bf16_exactness.py and
docs/ARCHITECTURE.md "Precision" derive it); `engine_logit_error` measures the engine's actual
error in the step shapes it runs, so a test can check the bound instead of trusting it.
"""

from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from ssd_engine.core.config import EngineConfig
from ssd_engine.runtime.model_runner import RunnerSpec
from ssd_engine.runtime.step_inputs import StepInputs

BF16_UNIT_ROUNDOFF = 2.0**-8  # 8 significant bits (7 stored + the implicit one), round to nearest


class Fp64Reference:
    def __init__(self, path: str) -> None:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager"
        )
        with torch.no_grad():  # the engine's weights exactly: rounded once to bf16, then widened
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16).to(torch.float64))
        self.model, self.path = model.eval(), path
        self.num_layers = model.config.num_hidden_layers

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), V] fp64: row i scores the token after tokens[:i + 1]."""
        return self.model(torch.tensor([tokens])).logits[0]

    def emitted_rows(self, prompt: list[int], emitted: list[int]) -> torch.Tensor:
        """[len(emitted), V]: the logits each emitted token was chosen from, in one forward."""
        return self.logits(prompt + emitted)[len(prompt) - 1 : len(prompt) + len(emitted) - 1]


def logit_error_bound(num_layers: int, logit_scale: float) -> float:
    """First-order bound on |bf16 logits - fp64 logits|: 4L + 2 bf16 roundings on the way to the
    logits (per layer: the attention output, the residual add, the MLP output, the residual add;
    then the final norm and the LM head), each at most u relative, all aligned, on vectors no
    larger than the logits' scale."""
    return (4 * num_layers + 2) * BF16_UNIT_ROUNDOFF * logit_scale


def deficits(rows: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Per position: max logit - logit of the token taken there (0 where it is the argmax)."""
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device).unsqueeze(1)).squeeze(1)
    return rows.max(dim=-1).values - chosen


def engine_logit_error(
    reference: Fp64Reference,
    runs: list[tuple[list[int], list[int]]],
    device: str,
    k: int,
    block_size: int,
) -> float:
    """max |engine bf16 logits - fp64| over the emitted positions of `runs` (prompt, emitted), with
    each sequence fed in the engine's three step shapes: one prefill of everything, the prompt then
    one token per step (decode), the prompt then K + 1 tokens per step (verification)."""
    path, longest = reference.path, max(len(p) + len(e) for p, e in runs)
    # the weight layout and attention backend the engine itself uses
    config = EngineConfig.from_kwargs(
        model=path, dtype="bfloat16", device=device, speculative_mode="ar", block_size=block_size
    )
    blocks = -(-longest // block_size)
    runner = RunnerSpec(
        replace(config.model, path=path), replace(config.cache, num_kv_blocks=blocks), longest + 1
    ).build()
    table = list(range(blocks))  # runs go one after another: each rewrites every slot it reads
    worst = 0.0
    for prompt, emitted in runs:
        tokens = prompt + emitted
        expected = reference.logits(tokens)[len(prompt) - 1 : len(tokens) - 1]
        for step in (len(tokens), 1, k + 1):
            rows = torch.cat(
                [
                    runner.run(StepInputs([a], [tokens[a:b]], [table], [list(range(b - a))]))
                    for a, b in _steps(len(prompt), len(tokens), step)
                ]
            )
            actual = rows[len(prompt) - 1 : len(tokens) - 1].double().cpu()
            worst = max(worst, (actual - expected).abs().max().item())
    return worst


def _steps(prompt_len: int, total: int, step: int) -> list[tuple[int, int]]:
    """[start, end) of each forward: the prompt's prefill, then `step` tokens at a time (a step
    covering the whole sequence: one prefill of everything)."""
    if step >= total:
        return [(0, total)]
    return [(0, prompt_len)] + [(s, min(s + step, total)) for s in range(prompt_len, total, step)]
