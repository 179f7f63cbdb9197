"""API keys for the server (`--api-key`, `SSD_ENGINE_API_KEY`), as vLLM takes them. With keys set,
every path but the open ones needs `Authorization: Bearer KEY`, else a 401; routes are closed by
default, so one added later is never open by accident. Keys are kept only as SHA-256 digests, never
in a message. Standard library only: the CLI resolves keys before importing the server packages."""

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Mapping

ENV_VAR = "SSD_ENGINE_API_KEY"
KEY_FLAG = "--api-key"


class ApiKeys:
    """The accepted keys, as digests only: no plaintext to leak into a repr, a traceback or a log."""

    def __init__(self, keys: Iterable[str], source: str = KEY_FLAG) -> None:
        self._digests = tuple(_digest(key) for key in keys)
        if not self._digests:
            raise ValueError("ApiKeys needs at least one key")
        self.source = (
            source  # where the keys came from, for the start line: the flag or the variable
        )

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} key{'s' if len(self) != 1 else ''} from {self.source})"

    def accepts(self, presented: str | None) -> bool:
        """Whether `presented` is one of the keys. Every key's digest is compared in constant
        time, so the time taken says neither which key matched nor how much of one did."""
        candidate = _digest(presented if presented is not None else "")
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(candidate, digest)
        return matched and presented is not None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def check_key(key: str, source: str) -> str:
    """A key as given, its ends stripped (a file's trailing newline); refused, without being echoed, if it is empty
    or holds anything but visible ASCII (it travels in an HTTP header)."""
    key = key.strip()
    if not key:
        raise ValueError(f"{source}: an API key is empty")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{source}: an API key may hold only visible ASCII characters (no spaces)")
    return key


def resolve_keys(flag_keys: list[str] | None, environ: Mapping[str, str]) -> ApiKeys | None:
    """vLLM's rule: the keys of `--api-key` if given (the environment variable is then ignored), else the
    variable's (empty counts as unset); None: no key, the server is open. Unlike VLLM_API_KEY the variable
    may hold several keys, comma-separated, so that several keys can stay out of the process list too."""
    if flag_keys:
        return ApiKeys([check_key(k, KEY_FLAG) for k in flag_keys], KEY_FLAG)
    value = environ.get(ENV_VAR, "")
    if not value.strip():
        return None
    return ApiKeys([check_key(k.strip(), ENV_VAR) for k in value.split(",")], ENV_VAR)


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (the scheme in any case); None when absent or another
    scheme."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on this machine only: localhost, 127.0.0.0/8, ::1 (also IPv4-mapped).
    Anything else (0.0.0.0, ::, an interface's address, another name) may be reached from outside."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def access_line(host: str, keys: ApiKeys | None, open_paths: Iterable[str]) -> str | None:
    """The line the CLI prints at start about who may call the server, naming no key: the keys'
    count and source, or a warning when no key guards a server reachable beyond this machine; None
    for an open one on loopback."""
    if keys is not None:
        n = len(keys)
        return (
            f"[serve] API key required (Authorization: Bearer) on every request but {', '.join(open_paths)} "
            f"({n} key{'s' if n != 1 else ''} from {keys.source})"
        )
    if not is_loopback(host):
        return (
            f"[serve] warning: listening on {host or 'every address'} with no API key: anyone who can reach "
            f"this port can use the server (set {KEY_FLAG} or {ENV_VAR})"
        )
    return None


Respond = Callable[[str], Callable[[dict, Callable, Callable], Awaitable[None]]]


class RequireApiKey:
    """ASGI middleware: a request to any path but `open_paths` without an accepted bearer key is answered by
    `respond(message)` (an ASGI response: the app's OpenAI-shaped 401), and never reaches the app. Plain ASGI,
    not BaseHTTPMiddleware, so streams and client disconnects pass through untouched."""

    def __init__(self, app, keys: ApiKeys, open_paths: Iterable[str], respond: Respond) -> None:
        self.app, self.keys, self.open_paths, self.respond = (
            app,
            keys,
            frozenset(open_paths),
            respond,
        )

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = next(
            (
                value.decode("latin-1")
                for name, value in scope.get("headers", ())
                if name.lower() == b"authorization"
            ),
            None,
        )
        token = bearer_token(header)
        if self.keys.accepts(token):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # closing before accepting refuses the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        if header is None:
            message = "no API key: send it in an 'Authorization: Bearer <key>' header"
        elif token is None:
            message = "the Authorization header is not 'Bearer <key>'"
        else:
            message = "invalid API key"
        await self.respond(message)(scope, receive, send)
