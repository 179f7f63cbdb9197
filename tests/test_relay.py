"""The replicas' relay (ssd_engine/server/relay.py), without Ray: an app's response carried in pieces,
and a request retried on another replica exactly while nothing of its response has been sent."""

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from ssd_engine.server import relay as relay_module
from ssd_engine.server.relay import HttpRequest, ResponseHead, relay, run_app


class ReplicaDied(Exception):
    pass


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(body: dict):
        return {"got": body, "n": len(body)}

    @app.get("/v1/stream")
    async def stream(count: int):
        async def pieces():
            for i in range(count):
                yield f"data: {i}\n\n"

        return StreamingResponse(pieces(), media_type="text/event-stream")

    return app


async def _collect(pieces) -> tuple[ResponseHead, list[bytes]]:
    head, chunks = None, []
    async for piece in pieces:
        if isinstance(piece, ResponseHead):
            head = piece
        else:
            chunks.append(piece)
    return head, chunks


def test_an_apps_response_comes_back_as_its_head_then_its_pieces():
    app = _app()
    post = HttpRequest(
        "POST", "/v1/echo", b"", [(b"content-type", b"application/json")], b'{"a": 1}'
    )
    head, chunks = asyncio.run(_collect(run_app(app, post)))
    assert head.status == 200 and b"".join(chunks) == b'{"got":{"a":1},"n":1}'
    assert (b"content-type", b"application/json") in head.headers
    head, chunks = asyncio.run(
        _collect(run_app(app, HttpRequest("GET", "/v1/stream", b"count=3", [], b"")))
    )
    assert head.status == 200 and chunks == [
        b"data: 0\n\n",
        b"data: 1\n\n",
        b"data: 2\n\n",
    ]  # a stream stays one
    head, _ = asyncio.run(_collect(run_app(app, HttpRequest("GET", "/nowhere", b"", [], b""))))
    assert head.status == 404


def _replicas(behaviours: list[str]):
    """call() for relay: the i-th call's replica behaves as behaviours[i]: 'dies' before its head,
    'dies-after-head', 'dies-mid-body' (after its first chunk), 'fails' (an error that is not a death),
    or 'ok'."""
    calls = []

    def call():
        behaviour = behaviours[len(calls)]
        calls.append(behaviour)

        async def pieces():
            if behaviour == "dies":
                raise ReplicaDied()
            if behaviour == "fails":
                raise ValueError("bad request")
            yield ResponseHead(200, [])
            if behaviour == "dies-after-head":
                raise ReplicaDied()
            yield b"first"
            if behaviour == "dies-mid-body":
                raise ReplicaDied()
            yield b"rest"

        return pieces()

    return call, calls


async def _relayed(call) -> bytes:
    head, body = await relay(call, lambda error: isinstance(error, ReplicaDied))
    return b"".join([chunk async for chunk in body])


def test_a_replica_that_dies_before_the_first_body_bytes_costs_a_retry(monkeypatch):
    monkeypatch.setattr(relay_module, "RETRY_PAUSE_S", 0.0)
    call, calls = _replicas(["dies", "dies-after-head", "ok"])
    assert asyncio.run(_relayed(call)) == b"firstrest" and len(calls) == 3


def test_after_the_first_body_bytes_or_on_other_errors_nothing_is_retried(monkeypatch):
    monkeypatch.setattr(relay_module, "RETRY_PAUSE_S", 0.0)
    call, calls = _replicas(["dies-mid-body", "ok"])
    with pytest.raises(ReplicaDied):  # the client already has bytes of this replica's answer
        asyncio.run(_relayed(call))
    assert len(calls) == 1
    call, calls = _replicas(["fails", "ok"])
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(_relayed(call))
    assert len(calls) == 1
    call, calls = _replicas(["dies"] * relay_module.ATTEMPTS + ["ok"])
    # every attempt's replica died: the error, after ATTEMPTS tries
    with pytest.raises(ReplicaDied):
        asyncio.run(_relayed(call))
    assert len(calls) == relay_module.ATTEMPTS
