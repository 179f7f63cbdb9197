"""One HTTP request carried to an engine replica's app as plain values (`HttpRequest`, `run_app`)
and its response carried back in pieces, so a stream stays a stream. `relay` (the ingress's side)
retries a replica that dies before any body byte reached the client on another."""

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

ATTEMPTS = 4  # a request's replicas: the first and up to three retries
RETRY_PAUSE_S = 0.5  # times the attempt number: time for the router to see the replica gone


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]


async def run_app(app, request: HttpRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Replica side: the head of `app`'s response to `request`, then its body chunks as it sends them."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query,
        "headers": request.headers,
        "client": None,
        "server": None,
    }
    sent: asyncio.Queue = asyncio.Queue()
    received = False

    async def receive() -> dict:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        # the client never disconnects: the ingress holds the connection
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    complete = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    complete = True
                    break
        if not complete:
            task.result()  # the app ended without a whole response: its error
    finally:
        if complete:
            await task  # its last steps after the body's end
        elif not task.done():
            task.cancel()  # the ingress stopped reading (its client left): the app's request ends too


async def relay(
    call: Callable[[], AsyncIterator[ResponseHead | bytes]],
    replica_died: Callable[[BaseException], bool],
) -> tuple[ResponseHead, AsyncIterator[bytes]]:
    """Ingress side: (head, body) of one replica's response, from `call()` (a new replica's response
    each time). A replica that dies before its first body chunk (or before its end, for an empty
    body) is retried on another, up to ATTEMPTS in all; any other error propagates."""
    for attempt in range(1, ATTEMPTS + 1):
        pieces = aiter(call())
        try:
            head = await anext(pieces)
            first = await anext(pieces, b"")
        except Exception as error:
            if not replica_died(error) or attempt == ATTEMPTS:
                raise
            print(
                f"[serve] a replica died before answering ({type(error).__name__}): retrying on another "
                f"(attempt {attempt + 1} of {ATTEMPTS})",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(RETRY_PAUSE_S * attempt)
            continue
        return head, _body(first, pieces)
    raise AssertionError("unreachable")


async def _body(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk
