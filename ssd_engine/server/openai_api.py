"""The OpenAI-compatible HTTP API over one AsyncEngine: /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics (Prometheus); streams are Server-Sent Events ending with [DONE]
(the bodies and chunks: openai_bodies.py).
Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}; unimplemented fields are
a 400 naming them, never ignored. API keys: auth.py."""

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ssd_engine.server.async_engine import AsyncEngine, Overloaded
from ssd_engine.server.auth import ApiKeys, RequireApiKey
from ssd_engine.server.metrics import ServerMetrics
from ssd_engine.server.openai_bodies import OpenAIBodies
from ssd_engine.server.requests import BadRequest, ChatRequest, CompletionRequest, SamplingRequest


def error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
    )


def open_paths(metrics_require_key: bool = False) -> tuple[str, ...]:
    """The paths a server with API keys answers without one: probes (/health) and, by default, scrapes (/metrics)."""
    return ("/health",) if metrics_require_key else ("/health", "/metrics")


def build_app(
    async_engine: AsyncEngine,
    model_name: str,
    api_keys: ApiKeys | None = None,
    metrics_require_key: bool = False,
    every_replicas_metrics=None,
) -> FastAPI:
    """The OpenAI app in front of one engine. `every_replicas_metrics`: an async callable whose bytes
    /metrics answers instead of this engine's own (server/replica_metrics.py); `app.state.own_metrics`
    renders this engine's."""
    if metrics_require_key and api_keys is None:
        raise ValueError("metrics_require_key needs API keys")
    app = FastAPI(title="ssd_engine")
    tokenizer = async_engine.llm.tokenizer
    # what a request's unset sampling fields take
    defaults = async_engine.llm.get_default_sampling_params()
    request_fields = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
    metrics = ServerMetrics()
    bodies = OpenAIBodies(model_name, tokenizer, metrics)

    def reject(status: int, message: str, **fields) -> JSONResponse:
        metrics.rejected.labels(str(status)).inc()
        return error(status, message, **fields)

    if api_keys is not None:

        def unauthorized(message: str) -> JSONResponse:
            response = reject(401, message, code="invalid_api_key")
            response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750
            return response

        app.add_middleware(
            RequireApiKey,
            keys=api_keys,
            open_paths=open_paths(metrics_require_key),
            respond=unauthorized,
        )

    async def _indexed(firsts: list, streams: list):
        """(sample index, Delta) as each of a request's samples produces them, each sample's in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                await queue.put((index, firsts[index]))
                async for delta in streams[index]:
                    await queue.put((index, delta))
            # an engine failure reaches the reader, not the event loop's log
            except Exception as exc:
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
            return reject(
                400,
                f"unsupported field {where!r}: this server does not implement it",
                param=where,
                code="unsupported_field",
            )
        return reject(400, f"invalid {where!r}: {first.get('msg')}", param=where or None)

    async def own_metrics() -> bytes:
        return metrics.render(await async_engine.snapshot(), async_engine.aborted)

    app.state.own_metrics = own_metrics

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(
            await (every_replicas_metrics or own_metrics)(), media_type=CONTENT_TYPE_LATEST
        )

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "ssd_engine"}],
        }

    async def _serve(body: SamplingRequest, prompt, kind: str):
        if body.model != model_name:
            return reject(
                404,
                f"model {body.model!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        try:
            body.check()
            max_tokens = body.requested_max_tokens()
            params = body.params(
                defaults,
                max_tokens if max_tokens is not None else async_engine.max_tokens_room(prompt),
            )
            # checked once, before any is queued
            samples = async_engine.engine.make_samples(prompt, params)
            if params.n > 1 and not body.stream:
                answered = await asyncio.gather(*(_whole(prompt, params, seq) for seq in samples))
            else:
                streams = [
                    async_engine.generate(prompt, params, stream=body.stream, seq=seq)
                    for seq in samples
                ]
                try:  # overload errors surface here, before any byte is sent
                    firsts = [await anext(stream) for stream in streams]
                except BaseException:
                    for stream in streams:  # the samples already queued are aborted
                        await stream.aclose()
                    raise
        except BadRequest as exc:
            return reject(400, str(exc), param=exc.param)
        # SamplingParams' and the engine's messages start with the field they are about
        except ValueError as exc:
            named = str(exc).split(" ", 1)[0]
            if named == "max_tokens" and body.max_completion_tokens is not None:
                named = "max_completion_tokens"
            # the engine's compile error: name the field the spec came in
            elif named.startswith("structured_outputs"):
                named = body.structure_field() or named
            return reject(400, str(exc), param=named if named in request_fields else None)
        except Overloaded as exc:
            return reject(503, str(exc), kind="server_overloaded", code="overloaded")
        rid, created = (
            f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            int(time.time()),
        )
        if params.n > 1 and not body.stream:
            return bodies.response(rid, created, kind, answered, params.logprobs or 0)
        if body.stream:
            return StreamingResponse(
                bodies.stream(
                    _indexed(firsts, streams),
                    params.n,
                    rid,
                    created,
                    kind,
                    body.stream_options,
                    params.logprobs or 0,
                ),
                media_type="text/event-stream",
            )
        return bodies.response(
            rid, created, kind, [await _joined(firsts[0], streams[0])], params.logprobs or 0
        )

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await _serve(body, body.prompt, "completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        if not tokenizer.chat_template:
            return reject(400, f"model {model_name!r} has no chat template; use /v1/completions")
        prompt = tokenizer.apply_chat_template(
            [m.model_dump() for m in body.messages], tokenize=False, add_generation_prompt=True
        )
        return await _serve(body, prompt, "chat")

    return app
