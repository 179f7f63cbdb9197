"""What a finished request gives back to the caller."""

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    ttft_s: float  # arrival -> first output token
    e2e_s: float  # arrival -> finish
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache at the last admission

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.e2e_s - self.ttft_s
        return (self.num_output_tokens - 1) / decode_time if decode_time > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's name and fields)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length"
    metrics: RequestMetrics
    spec_metrics: dict = field(default_factory=dict)  # filled by speculative modes
    # per output token {token id: log-probability}, the chosen token first, then the top N (params.logprobs)
    logprobs: list[dict[int, float]] | None = None
    # every sample (params.n, in index order); text, token_ids and logprobs above are the first's
    outputs: list[CompletionOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [
                CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)
            ]
