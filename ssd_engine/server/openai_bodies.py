"""OpenAI's response bodies for one served model: choices, usage, whole responses and SSE chunks."""

import json

from ssd_engine.server.logprobs_format import chat_logprobs, completion_logprobs
from ssd_engine.server.requests import StreamOptions


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class OpenAIBodies:
    """What one server sends for `model_name`: log-probabilities decoded with `tokenizer`, and
    each output a stream finishes counted in `metrics` (ServerMetrics)."""

    def __init__(self, model_name: str, tokenizer, metrics) -> None:
        self.model_name, self.tokenizer, self.metrics = model_name, tokenizer, metrics

    def choice(
        self,
        kind: str,
        text: str,
        finish: str | None,
        streaming: bool,
        first: bool = False,
        logprobs: list[dict[int, float]] | None = None,
        top: int = 0,
        index: int = 0,
    ) -> dict:
        if kind == "chat":
            # as OpenAI does, a stream names the role once, in its first delta
            body = (
                {"role": "assistant", "content": text}
                if first or not streaming
                else {"content": text}
            )
            return {
                "index": index,
                "delta" if streaming else "message": body,
                "finish_reason": finish,
                "logprobs": None
                if logprobs is None
                else chat_logprobs(self.tokenizer, logprobs, top),
            }
        return {
            "index": index,
            "text": text,
            "finish_reason": finish,
            "logprobs": None
            if logprobs is None
            else completion_logprobs(self.tokenizer, logprobs, top),
        }

    def response(self, rid, created, kind, answered: list[tuple[str, object]], top: int) -> dict:
        """`answered`: (text, RequestOutput) of each of the request's n samples, in index order."""
        choices = [
            {
                **self.choice(kind, text, output.finish_reason, False, False, output.logprobs, top),
                "index": i,
            }
            for i, (text, output) in enumerate(answered)
        ]
        usage = usage_counts(
            answered[0][1].metrics.num_prompt_tokens,
            sum(o.metrics.num_output_tokens for _, o in answered),
        )
        return {
            "id": rid,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage,
        }

    async def stream(
        self, deltas, n: int, rid, created, kind, options: StreamOptions | None, top: int
    ):
        """`deltas`: (sample index, Delta) pairs (openai_api.py's `_indexed`). Without stream_options
        the chunk that ends the last sample carries `usage`; with include_usage every chunk has
        `"usage": null` (or, with continuous_usage_stats, the usage so far) and a last chunk with
        empty `choices` carries the total, as OpenAI sends it; include_usage false: no usage."""
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        separate = options is not None and options.include_usage
        continuous = separate and options.continuous_usage_stats
        first, generated, finished = [True] * n, [0] * n, []
        try:
            async for index, delta in deltas:
                chunk = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [
                        self.choice(
                            kind,
                            delta.text,
                            delta.output.finish_reason if delta.output else None,
                            True,
                            first[index],
                            delta.logprobs,
                            top,
                            index,
                        )
                    ],
                }
                first[index], generated[index] = False, delta.num_output_tokens
                if continuous:
                    chunk["usage"] = usage_counts(delta.num_prompt_tokens, sum(generated))
                elif separate:
                    chunk["usage"] = None
                if delta.output is not None:
                    finished.append(delta.output)
                    self.metrics.finished(delta.output)
                    if options is None and len(finished) == n:
                        chunk["usage"] = usage_counts(delta.num_prompt_tokens, sum(generated))
                yield f"data: {json.dumps(chunk)}\n\n"
            if separate:
                last = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": usage_counts(finished[0].metrics.num_prompt_tokens, sum(generated)),
                }
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnected mid-stream: the requests are aborted now
            await deltas.aclose()
