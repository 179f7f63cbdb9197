"""The OpenAI-compatible HTTP API over one AsyncEngine: /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics (Prometheus); streams are Server-Sent Events ending with [DONE].
Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}; unimplemented fields are
a 400 naming them, never ignored. API keys: auth.py."""
import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ssd_engine.server.async_engine import AsyncEngine, Overloaded
from ssd_engine.server.auth import ApiKeys, RequireApiKey
from ssd_engine.server.logprobs_format import chat_logprobs, completion_logprobs
from ssd_engine.server.metrics import ServerMetrics
from ssd_engine.server.requests import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
    StreamOptions,
)


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def open_paths(metrics_require_key: bool = False) -> tuple[str, ...]:
    """The paths a server with API keys answers without one: probes (/health) and, by default, scrapes (/metrics)."""
    return ("/health",) if metrics_require_key else ("/health", "/metrics")


def build_app(async_engine: AsyncEngine, model_name: str, api_keys: ApiKeys | None = None,
              metrics_require_key: bool = False, every_replicas_metrics=None) -> FastAPI:
    """The OpenAI app in front of one engine. `every_replicas_metrics`: an async callable whose bytes
    /metrics answers instead of this engine's own (server/replica_metrics.py); `app.state.own_metrics`
    renders this engine's."""
    if metrics_require_key and api_keys is None:
        raise ValueError("metrics_require_key needs API keys")
    app = FastAPI(title="ssd_engine")
    tokenizer = async_engine.llm.tokenizer
    defaults = async_engine.llm.get_default_sampling_params()  # what a request's unset sampling fields take
    request_fields = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
    metrics = ServerMetrics()

    def reject(status: int, message: str, **fields) -> JSONResponse:
        metrics.rejected.labels(str(status)).inc()
        return error(status, message, **fields)

    if api_keys is not None:
        def unauthorized(message: str) -> JSONResponse:
            response = reject(401, message, code="invalid_api_key")
            response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750
            return response
        app.add_middleware(RequireApiKey, keys=api_keys, open_paths=open_paths(metrics_require_key),
                           respond=unauthorized)

    async def _indexed(firsts: list, streams: list):
        """(sample index, Delta) as each of a request's samples produces them, each sample's in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                await queue.put((index, firsts[index]))
                async for delta in streams[index]:
                    await queue.put((index, delta))
            except Exception as exc:  # an engine failure reaches the reader, not the event loop's log
                await queue.put((index, exc))
        tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
        try:
            ended = 0
            while ended < len(streams):
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                ended += item.output is not None
                yield index, item
        finally:  # a pump cancelled mid-read closes its stream, which aborts an unfinished sample
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()

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

    async def own_metrics() -> bytes:
        return metrics.render(await async_engine.snapshot(), async_engine.aborted)
    app.state.own_metrics = own_metrics

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await (every_replicas_metrics or own_metrics)(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "ssd_engine"}]}

    async def _serve(body: SamplingRequest, prompt, kind: str):
        if body.model != model_name:
            return reject(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                         param="model", code="model_not_found")
        try:
            body.check()
            max_tokens = body.requested_max_tokens()
            params = body.params(defaults, max_tokens if max_tokens is not None else async_engine.max_tokens_room(prompt))
            samples = async_engine.engine.make_samples(prompt, params)  # checked once, before any is queued
            if params.n > 1 and not body.stream:
                answered = await asyncio.gather(*(_whole(prompt, params, seq) for seq in samples))
            else:
                streams = [async_engine.generate(prompt, params, stream=body.stream, seq=seq) for seq in samples]
                try:  # overload errors surface here, before any byte is sent
                    firsts = [await anext(stream) for stream in streams]
                except BaseException:
                    for stream in streams:  # the samples already queued are aborted
                        await stream.aclose()
                    raise
        except BadRequest as exc:
            return reject(400, str(exc), param=exc.param)
        except ValueError as exc:  # SamplingParams' and the engine's messages start with the field they are about
            named = str(exc).split(" ", 1)[0]
            if named == "max_tokens" and body.max_completion_tokens is not None:
                named = "max_completion_tokens"
            elif named.startswith("structured_outputs"):  # the engine's compile error: name the field the spec came in
                named = body.structure_field() or named
            return reject(400, str(exc), param=named if named in request_fields else None)
        except Overloaded as exc:
            return reject(503, str(exc), kind="server_overloaded", code="overloaded")
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if params.n > 1 and not body.stream:
            return _response(rid, created, kind, answered, params.logprobs or 0)
        if body.stream:
            return StreamingResponse(_sse(_indexed(firsts, streams), params.n, rid, created, kind, body.stream_options,
                                          params.logprobs or 0), media_type="text/event-stream")
        return _response(rid, created, kind, [await _joined(firsts[0], streams[0])], params.logprobs or 0)

    async def _joined(first, stream) -> tuple[str, object]:
        """(the whole text, the RequestOutput) of a request's deltas."""
        text, output = first.text, first.output
        async for delta in stream:
            text, output = text + delta.text, delta.output
        metrics.finished(output)
        return text, output

    async def _whole(prompt, params, seq) -> tuple[str, object]:
        """One of n samples, not streamed."""
        stream = async_engine.generate(prompt, params, stream=False, seq=seq)
        return await _joined(await anext(stream), stream)

    def _choice(kind: str, text: str, finish: str | None, streaming: bool, first: bool = False,
                logprobs: list[dict[int, float]] | None = None, top: int = 0, index: int = 0) -> dict:
        if kind == "chat":
            # as OpenAI does, a stream names the role once, in its first delta
            body = {"role": "assistant", "content": text} if first or not streaming else {"content": text}
            return {"index": index, "delta" if streaming else "message": body, "finish_reason": finish,
                    "logprobs": None if logprobs is None else chat_logprobs(tokenizer, logprobs, top)}
        return {"index": index, "text": text, "finish_reason": finish,
                "logprobs": None if logprobs is None else completion_logprobs(tokenizer, logprobs, top)}

    def _usage(output) -> dict:
        m = output.metrics
        return _counts(m.num_prompt_tokens, m.num_output_tokens)

    def _counts(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _response(rid, created, kind, answered: list[tuple[str, object]], top: int) -> dict:
        """`answered`: (text, RequestOutput) of each of the request's n samples, in index order."""
        choices = [{**_choice(kind, text, output.finish_reason, False, False, output.logprobs, top), "index": i}
                   for i, (text, output) in enumerate(answered)]
        usage = _counts(answered[0][1].metrics.num_prompt_tokens, sum(o.metrics.num_output_tokens for _, o in answered))
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": model_name, "choices": choices, "usage": usage}

    async def _sse(deltas, n: int, rid, created, kind, options: StreamOptions | None, top: int):
        """`deltas`: (sample index, Delta) pairs (`_indexed`). Without stream_options the chunk
        that ends the last sample carries `usage`; with include_usage every chunk has `"usage":
        null` (or, with continuous_usage_stats, the usage so far) and a last chunk with empty
        `choices` carries the total, as OpenAI sends it; include_usage false: no usage."""
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        separate = options is not None and options.include_usage
        continuous = separate and options.continuous_usage_stats
        first, generated, finished = [True] * n, [0] * n, []
        try:
            async for index, delta in deltas:
                chunk = {"id": rid, "object": obj, "created": created, "model": model_name,
                         "choices": [_choice(kind, delta.text, delta.output.finish_reason if delta.output else None,
                                             True, first[index], delta.logprobs, top, index)]}
                first[index], generated[index] = False, delta.num_output_tokens
                if continuous:
                    chunk["usage"] = _counts(delta.num_prompt_tokens, sum(generated))
                elif separate:
                    chunk["usage"] = None
                if delta.output is not None:
                    finished.append(delta.output)
                    metrics.finished(delta.output)
                    if options is None and len(finished) == n:
                        chunk["usage"] = _counts(delta.num_prompt_tokens, sum(generated))
                yield f"data: {json.dumps(chunk)}\n\n"
            if separate:
                last = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                        "usage": _counts(finished[0].metrics.num_prompt_tokens, sum(generated))}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnected mid-stream: the requests are aborted now
            await deltas.aclose()

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
