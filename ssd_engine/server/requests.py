"""The request bodies of the OpenAI-compatible API (pydantic models) and how each becomes SamplingParams.
Unknown fields are a 400 naming them. Structured outputs arrive as OpenAI's `response_format`,
vLLM's `structured_outputs`, or vLLM's older `guided_*` fields; at most one of them a request."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.core.structured_outputs import StructuredOutputsParams


class BadRequest(ValueError):
    """A 400 naming the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = True  # vLLM's default once stream_options is given
    # vLLM's extension (with include_usage): usage so far in every chunk
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict | None = Field(
        None, alias="schema"
    )  # `schema` would shadow pydantic's own attribute
    strict: bool | None = None  # the schema is always enforced here


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    # the chat API's newer name for max_tokens; wins when both are given
    max_completion_tokens: int | None = None
    # None (unset): the model's default, LLM.get_default_sampling_params()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # recorded by OpenAI for abuse tracking; no effect on generation
    ignore_eos: bool = False  # vLLM's extension: keep generating past EOS (benchmarks)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    repetition_penalty: float | None = None  # vLLM's extensions, from here on
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def requested_logprobs(self) -> int | None:
        return None

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if self.max_completion_tokens is not None and self.max_completion_tokens <= 0:
            raise BadRequest(
                f"max_completion_tokens must be an int > 0, got {self.max_completion_tokens!r}",
                "max_completion_tokens",
            )

    def requested_structure(self) -> StructuredOutputsParams | None:
        """The one structured-output field given, as StructuredOutputsParams (a BadRequest naming it if wrong)."""
        given = self._given_structure()
        if len(given) > 1:
            raise BadRequest(f"give one of {', '.join(given)}, not several", sorted(given)[1])
        if not given:
            return None
        ((name, value),) = given.items()
        try:
            if name == "response_format":
                if value.type == "json_object":
                    return StructuredOutputsParams(json_object=True)
                if value.json_schema is None or value.json_schema.json_schema is None:
                    raise ValueError("response_format json_schema needs json_schema.schema")
                return StructuredOutputsParams(json=value.json_schema.json_schema)
            return StructuredOutputsParams.of(
                value if name == "structured_outputs" else {GUIDED[name]: value}
            )
        except ValueError as exc:
            raise BadRequest(str(exc), name) from None

    def structure_field(self) -> str | None:
        """The request field that carried the structured-output spec (what a 400 about it names)."""
        return next(iter(self._given_structure()), None)

    def _given_structure(self) -> dict:
        given = {
            name: getattr(self, name)
            for name in ("structured_outputs", *GUIDED)
            if getattr(self, name) is not None
        }
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format
        return given

    def requested_max_tokens(self) -> int | None:
        """vLLM's rule: max_completion_tokens if given, else max_tokens; None: as many as fit."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def params(self, defaults: SamplingParams, max_tokens: int) -> SamplingParams:
        return SamplingParams.from_optional(
            defaults,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
            logprobs=self.requested_logprobs(),
            n=self.n,
            structured_outputs=self.requested_structure(),
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = None  # the legacy API's: the top N (0: the chosen token's alone)

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
