"""Per-request sampling parameters, with vLLM's field names and defaults. Every entry point fills
a field a request leaves unset by DEFAULTS_RULE. temperature=0 is greedy."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from ssd_engine.core.options import option
from ssd_engine.core.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # OpenAI's and vLLM's default limit on top log-probabilities


@dataclass
class SamplingParams:
    """How one request is decoded; each field's meaning is its `option` help (also the CLI's --help).
    stop / stop_token_ids are normalised to (possibly empty) lists."""

    n: int = option(
        1,
        "independent samples of the prompt; they share its KV pages (the prefix cache), and a "
        "seeded request's samples are reproducible (each its own stream)",
    )
    temperature: float = option(1.0, "0 is greedy (argmax); otherwise the logits are divided by it")
    top_p: float = option(
        1.0,
        "keep the smallest set of most likely tokens whose probability reaches top_p, "
        "in (0, 1] (1: off)",
    )
    top_k: int = option(-1, "keep the k most likely tokens; -1 and 0 both disable it, as in vLLM")
    min_p: float = option(
        0.0, "drop tokens less likely than min_p times the top token, in [0, 1] (0: off)"
    )
    seed: int | None = option(
        None,
        "a seeded request draws only from its own generator, so its output does "
        "not depend on the rest of the batch",
    )
    max_tokens: int = option(16, "most tokens to generate")
    stop: str | list[str] | None = option(
        None,
        "stop at the first occurrence of this string, which is cut "
        "from the text (CLI: repeat for several)",
    )
    stop_token_ids: list[int] | None = option(
        None, "stop once this token id is generated (CLI: repeat for several)"
    )
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token")
    presence_penalty: float = option(
        0.0,
        "subtract this from the logit of every token already generated, in "
        "[-2, 2] (OpenAI's; 0: off)",
    )
    frequency_penalty: float = option(
        0.0,
        "subtract this times a token's count so far in the output, in [-2, 2] (OpenAI's; 0: off)",
    )
    repetition_penalty: float = option(
        1.0,
        "divide a positive logit (multiply a negative one) by this for every "
        "token in the prompt or output, > 0 (transformers'; 1: off)",
    )
    logit_bias: dict[int, float] | None = option(
        None, "token id -> a bias added to its logit, in [-100, 100] (OpenAI's; CLI: a JSON object)"
    )
    min_tokens: int = option(
        0, "end-of-sequence and stop_token_ids are impossible before this many tokens"
    )
    logprobs: int | None = option(
        None,
        "return each generated token's log-probability and the N most likely "
        "tokens', in [0, 20] (0: the chosen token's alone), under the law it was "
        "drawn from: after penalties, temperature (greedy: 1) and the filters",
    )
    structured_outputs: StructuredOutputsParams | None = option(
        None,
        "the output must match a JSON schema, any JSON object, a regex, one of a list of strings or an EBNF "
        "grammar (core/structured_outputs.py); tokens it forbids get probability 0 in every mode",
    )

    def __post_init__(self) -> None:
        # `not (x >= 0)` also rejects nan, which compares false with everything.
        if not (self.temperature >= 0) or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or -1/0 to disable, got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens <= 0
        ):
            raise ValueError(f"max_tokens must be an int > 0, got {self.max_tokens!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2 <= getattr(self, name) <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not (self.repetition_penalty > 0) or math.isinf(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or self.min_tokens < 0
        ):
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        self.logit_bias = _checked_bias(self.logit_bias)
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """Whether a token's law depends on the tokens before it (sampling/penalties.py), beyond the model's."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    @classmethod
    def from_optional(cls, defaults: SamplingParams | None = None, **values) -> SamplingParams:
        """A request's params: a value that is None (unset) takes `defaults`' value for that field
        (`LLM.get_default_sampling_params()`: the model's defaults), else SamplingParams' own."""
        base = (
            {f.name: getattr(defaults, f.name) for f in fields(cls)} if defaults is not None else {}
        )
        return cls(
            **{**base, **{name: value for name, value in values.items() if value is not None}}
        )


def _checked_bias(bias) -> dict[int, float]:
    """logit_bias as {int id: float}; JSON's string keys ("50256") are taken as ids, as OpenAI's API does.
    Ids are checked against the vocabulary when the request is added (the engine knows its size)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
    checked = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (-100 <= value <= 100)
        ):
            raise ValueError(
                f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}"
            )
        checked[token] = float(value)
    return checked


# the fields a model's generation_config.json may set for requests that leave them unset (vLLM's)
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
DEFAULTS_RULE = (
    "temperature, top_p, top_k, min_p and repetition_penalty left unset take the model's "
    "generation_config.json value where it sets one, else 1.0, 1.0, -1, 0.0 and 1.0 (vLLM's rule), so "
    "it samples; temperature 0 is greedy and reproducible"
)


def model_sampling_defaults(model_path: str) -> dict:
    """The MODEL_DEFAULT_FIELDS that the folder's generation_config.json sets, as vLLM reads them
    (`do_sample` and every other field ignored), else {}. A value no request could take is a
    ValueError naming the file."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    from transformers import GenerationConfig

    # to_diff_dict: only what differs from transformers' own defaults, i.e. what the file set
    config = GenerationConfig.from_pretrained(model_path).to_diff_dict()
    found = {name: config[name] for name in MODEL_DEFAULT_FIELDS if config.get(name) is not None}
    try:
        SamplingParams(**found)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return found
