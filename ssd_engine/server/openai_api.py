"""The OpenAI-compatible HTTP API over one AsyncEngine: /v1/completions, /v1/chat/completions
(the model's chat template), /v1/models, /health, /metrics (Prometheus). Streaming answers are Server-Sent Events in
OpenAI's chunk format ending with `data: [DONE]`; the last chunk carries `usage`. Errors have
OpenAI's shape {"error": {"message", "type", "param", "code"}}; fields this server does not
implement are rejected with a 400 naming them, never ignored."""
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict

from ssd_engine.core.sampling_params import SamplingParams
from ssd_engine.server.async_engine import AsyncEngine, Overloaded
from ssd_engine.server.metrics import ServerMetrics


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it
    model: str
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    seed: int | None = None
    n: Literal[1] = 1
    stream: bool = False
    user: str | None = None   # recorded by OpenAI for abuse tracking; no effect on generation
    ignore_eos: bool = False  # vLLM's extension: keep generating past EOS (benchmarks)

    def params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              max_tokens=self.max_tokens, stop=stop, ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def build_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    app = FastAPI(title="ssd_engine")
    tokenizer = engine.llm.tokenizer
    metrics = ServerMetrics()

    def reject(status: int, message: str, **fields) -> JSONResponse:
        metrics.rejected.labels(str(status)).inc()
        return error(status, message, **fields)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return reject(400, f"malformed JSON: {first.get('msg')}", code="malformed_json")
        if first.get("type") == "extra_forbidden":
            return reject(400, f"unsupported field {where!r}: this server does not implement it", param=where,
                         code="unsupported_field")
        return reject(400, f"invalid {where!r}: {first.get('msg')}", param=where or None)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(await engine.snapshot(), engine.aborted), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "ssd_engine"}]}

    async def _serve(body: _Sampling, prompt, kind: str):
        if body.model != model_name:
            return reject(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                         param="model", code="model_not_found")
        try:
            params = body.params()
            stream = engine.generate(prompt, params, stream=body.stream)
            first = await anext(stream)  # validation and overload errors surface here, before any byte is sent
        except ValueError as exc:
            return reject(400, str(exc))
        except Overloaded as exc:
            return reject(503, str(exc), kind="server_overloaded", code="overloaded")
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return StreamingResponse(_sse(first, stream, rid, created, kind), media_type="text/event-stream")
        text, output = first.text, first.output
        async for delta in stream:
            text, output = text + delta.text, delta.output
        metrics.finished(output)
        return _response(rid, created, kind, text, output)

    def _choice(kind: str, text: str, finish: str | None, streaming: bool, first: bool = False) -> dict:
        if kind == "chat":
            # as OpenAI does, a stream names the role once, in its first delta
            body = {"role": "assistant", "content": text} if first or not streaming else {"content": text}
            return {"index": 0, "delta" if streaming else "message": body, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def _usage(output) -> dict:
        m = output.metrics
        return {"prompt_tokens": m.num_prompt_tokens, "completion_tokens": m.num_output_tokens,
                "total_tokens": m.num_prompt_tokens + m.num_output_tokens}

    def _response(rid, created, kind, text, output) -> dict:
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": model_name, "choices": [_choice(kind, text, output.finish_reason, False)],
                "usage": _usage(output)}

    async def _sse(delta, stream, rid, created, kind):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        first = True
        try:
            while True:
                chunk = {"id": rid, "object": obj, "created": created, "model": model_name,
                         "choices": [_choice(kind, delta.text, delta.output.finish_reason if delta.output else None,
                                             True, first)]}
                first = False
                if delta.output is not None:
                    chunk["usage"] = _usage(delta.output)
                    metrics.finished(delta.output)
                yield f"data: {json.dumps(chunk)}\n\n"
                if delta.output is not None:
                    break
                delta = await anext(stream)
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnected mid-stream: the request is aborted now
            await stream.aclose()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await _serve(body, body.prompt, "completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        if not tokenizer.chat_template:
            return reject(400, f"model {model_name!r} has no chat template; use /v1/completions")
        prompt = tokenizer.apply_chat_template([m.model_dump() for m in body.messages], tokenize=False,
                                               add_generation_prompt=True)
        return await _serve(body, prompt, "chat")

    return app
