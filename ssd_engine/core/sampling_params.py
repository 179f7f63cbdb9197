"""Per-request sampling parameters, with vLLM's field names and defaults.

The rule for a field a request leaves unset (vLLM's; every entry point follows it: `LLM.generate`
without params, the CLI's sampling flags, the server's request fields): temperature, top_p, top_k and
min_p take the model's generation_config.json value where that file sets them, else the defaults
below (temperature 1.0: sampling). temperature=0 is greedy."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from ssd_engine.core.options import option


@dataclass
class SamplingParams:
    """How one request is decoded; each field's meaning is its `option` help (also the CLI's --help).
    stop / stop_token_ids are normalised to (possibly empty) lists."""

    temperature: float = option(1.0, "0 is greedy (argmax); otherwise the logits are divided by it")
    top_p: float = option(1.0, "keep the smallest set of most likely tokens whose probability reaches top_p, "
                               "in (0, 1] (1: off)")
    top_k: int = option(-1, "keep the k most likely tokens; -1 and 0 both disable it, as in vLLM")
    min_p: float = option(0.0, "drop tokens less likely than min_p times the top token, in [0, 1] (0: off)")
    seed: int | None = option(None, "a seeded request draws only from its own generator, so its output does "
                                    "not depend on the rest of the batch")
    max_tokens: int = option(16, "most tokens to generate")
    stop: str | list[str] | None = option(None, "stop at the first occurrence of this string, which is cut "
                                                "from the text (CLI: repeat for several)")
    stop_token_ids: list[int] | None = option(None, "stop once this token id is generated (CLI: repeat for "
                                                    "several)")
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token")

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
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be an int > 0, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_optional(cls, defaults: SamplingParams | None = None, **values) -> SamplingParams:
        """A request's params: a value that is None (unset) takes `defaults`' value for that field
        (`LLM.get_default_sampling_params()`: the model's defaults), else SamplingParams' own."""
        base = {f.name: getattr(defaults, f.name) for f in fields(cls)} if defaults is not None else {}
        return cls(**{**base, **{name: value for name, value in values.items() if value is not None}})


# the fields a model's generation_config.json may set for requests that leave them unset (vLLM reads these and
# repetition_penalty, which this engine does not implement, and max_new_tokens, which it leaves to each entry point)
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p")
DEFAULTS_RULE = ("temperature, top_p, top_k and min_p left unset take the model's generation_config.json value "
                 "where it sets one, else 1.0, 1.0, -1 and 0.0 (vLLM's rule), so it samples; temperature 0 is "
                 "greedy and reproducible")


def model_sampling_defaults(model_path: str) -> dict:
    """The MODEL_DEFAULT_FIELDS that the folder's generation_config.json sets, read by transformers'
    GenerationConfig as vLLM reads them: `do_sample` and every other field are ignored, so a file with
    `do_sample: false` alone, or without the file, gives {}. A value no request could take is a ValueError
    naming the file."""
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
