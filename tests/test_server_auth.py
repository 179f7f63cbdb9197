"""API keys on the OpenAI-compatible server (ssd_engine/server/auth.py), live on 127.0.0.1 (kernel-picked ports)
through the official `openai` client: the right key (either of two) answers, streamed and not; a wrong or missing
one is a 401 in OpenAI's error shape naming no key; /health stays open, /metrics too unless --metrics-require-key;
every other path is closed. Through the CLI: repeated --api-key flags, the SSD_ENGINE_API_KEY route (the flag wins,
as in vLLM), no key in anything the server prints, and the one warning line for a server bound beyond loopback with
no key. The comparison is checked by what it calls: hmac.compare_digest, on equal-length digests, once per key
whichever key matches (no early exit)."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn
from test_serve_cli import REPO_ROOT, Served

from ssd_engine import LLM, SamplingParams
from ssd_engine.serve import build_parser
from ssd_engine.server import auth
from ssd_engine.server.async_engine import AsyncEngine
from ssd_engine.server.auth import ApiKeys, access_line, bearer_token, is_loopback, resolve_keys
from ssd_engine.server.openai_api import build_app, open_paths

NAME = "tiny"
KEYS = ("sk-test-alpha-4f1c9e27", "sk-test-bravo-b83d0a65")
WRONG = "sk-test-wrong-0d9e7c31"
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def guarded(tiny_qwen2):
    """A server in this process with two keys, /metrics left open (the default)."""
    llm = LLM(tiny_qwen2, max_num_seqs=4, num_kv_blocks=128)
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[
        0
    ].text
    engine = AsyncEngine(llm, max_pending=16)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine, NAME, api_keys=ApiKeys(KEYS)), log_level="warning")
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield port, offline
    server.should_exit = True
    thread.join(timeout=10)
    engine.close()
    llm.close()


def client(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def get(
    port: int, path: str, headers: dict | None = None, body: dict | None = None
) -> tuple[int, dict, str]:
    """(status, headers, body text) of a raw request: no client in between to add or hide a header."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data,
        {"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def assert_401(status: int, headers: dict, text: str, needle: str) -> None:
    assert status == 401, (status, text)
    assert headers.get("www-authenticate", headers.get("WWW-Authenticate")) == "Bearer"
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (
        body
    )
    assert (
        body["error"]["type"] == "invalid_request_error"
        and body["error"]["code"] == "invalid_api_key"
    )
    assert body["error"]["param"] is None and needle in body["error"]["message"], body
    assert not any(key in text for key in (*KEYS, WRONG)), text


# ---- a live server with two keys --------------------------------------------------------------------------------
def test_either_key_answers_streamed_and_not(guarded):
    port, offline = guarded
    for key in KEYS:
        c = client(port, key)
        out = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == offline
        chunks = list(
            c.completions.create(
                model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
            )
        )
        assert "".join(ch.choices[0].text for ch in chunks) == offline
        assert [m.id for m in c.models.list().data] == [NAME]


@pytest.mark.parametrize("stream", [False, True])
def test_a_wrong_key_is_a_401_in_openai_shape(guarded, stream):
    port, _ = guarded
    with pytest.raises(openai.AuthenticationError) as caught:
        client(port, WRONG).completions.create(
            model=NAME, prompt=PROMPT, max_tokens=4, stream=stream
        )
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert caught.value.body["message"] == "invalid API key"
    with pytest.raises(openai.AuthenticationError):
        client(port, WRONG).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], stream=stream
        )
    assert_401(
        *get(
            port,
            "/v1/completions",
            {"Authorization": f"Bearer {WRONG}"},
            {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "stream": stream},
        ),
        "invalid API key",
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_missing_key_is_a_401_in_openai_shape(guarded, stream):
    port, _ = guarded
    with pytest.raises(openai.AuthenticationError) as caught:  # the client's header removed
        client(port, KEYS[0]).completions.create(
            model=NAME,
            prompt=PROMPT,
            max_tokens=4,
            stream=stream,
            extra_headers={"Authorization": openai.Omit()},
        )
    assert caught.value.status_code == 401 and "no API key" in caught.value.body["message"]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    assert_401(*get(port, "/v1/completions", body=body), "no API key")
    for header in ("Basic " + KEYS[0], KEYS[0], "Bearer", "Bearer "):  # not a bearer key
        assert_401(
            *get(port, "/v1/completions", {"Authorization": header}, body), "not 'Bearer <key>'"
        )


def test_the_scheme_is_case_insensitive_and_the_key_exact(guarded):
    port, _ = guarded
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}
    assert get(port, "/v1/completions", {"Authorization": f"bearer {KEYS[1]}"}, body)[0] == 200
    for near in (KEYS[0][:-1], KEYS[0] + "x", KEYS[0].upper(), KEYS[0] + "," + KEYS[1]):
        assert_401(
            *get(port, "/v1/completions", {"Authorization": f"Bearer {near}"}, body),
            "invalid API key",
        )


def test_health_and_metrics_are_open_everything_else_closed(guarded):
    port, _ = guarded
    status, _, text = get(port, "/health")
    assert status == 200 and json.loads(text) == {"status": "ok"}
    assert_401(
        *get(port, "/v1/models"), "no API key"
    )  # this test's own 401: xdist may run it first
    status, _, metrics = get(port, "/metrics")
    assert (
        status == 200 and 'ssd_rejected_requests_total{status="401"}' in metrics
    )  # 401s are counted
    # closed by default: the API, and paths that are not the API (docs, unknown ones) are no way around it
    for path in (
        "/v1/models",
        "/v1",
        "/v1/",
        "/docs",
        "/openapi.json",
        "/nowhere",
        "/health/",
        "//v1/models",
    ):
        assert_401(*get(port, path), "no API key")
    assert get(port, "/v1/models", {"Authorization": f"Bearer {KEYS[0]}"})[0] == 200


# ---- where the keys come from --------------------------------------------------------------------------------
def test_the_flag_takes_several_keys_repeated_or_not():
    assert build_parser().parse_args([]).api_key is None
    assert build_parser().parse_args(["--api-key", "a1", "b2"]).api_key == [
        "a1",
        "b2",
    ]  # vLLM's form
    assert build_parser().parse_args(["--api-key", "a1", "--api-key=b2"]).api_key == ["a1", "b2"]


def test_the_flag_wins_over_the_variable_which_holds_one_key():
    env = {auth.ENV_VAR: "env-key-1"}
    keys = resolve_keys(["flag-key"], env)
    assert keys.source == "--api-key" and keys.accepts("flag-key") and not keys.accepts("env-key-1")
    keys = resolve_keys(None, env)
    assert keys.source == auth.ENV_VAR and len(keys) == 1 and keys.accepts("env-key-1")
    keys = resolve_keys(
        None, {auth.ENV_VAR: "k1, k2\n"}
    )  # several keys, none of them in the process list
    assert (
        len(keys) == 2 and keys.accepts("k1") and keys.accepts("k2") and not keys.accepts("k1,k2")
    )
    assert resolve_keys(None, {}) is None and resolve_keys(None, {auth.ENV_VAR: ""}) is None


@pytest.mark.parametrize(
    "flag, env, mark",
    [
        (["sk-ok-1d2e", " "], {}, None),
        (["sk-9f3a with-space"], {}, "9f3a"),
        (["sk-naïve-77b1"], {}, "77b1"),
        (None, {auth.ENV_VAR: "sk\t-c0de"}, "c0de"),
    ],
)
def test_a_bad_key_is_refused_without_being_echoed(flag, env, mark):
    with pytest.raises(ValueError) as caught:
        resolve_keys(flag, env)
    message = str(caught.value)
    assert ("--api-key" if flag else auth.ENV_VAR) in message and "1d2e" not in message
    assert (
        "empty" in message if mark is None else (mark not in message and "visible ASCII" in message)
    )


def test_keys_are_kept_as_digests_and_never_shown():
    keys = ApiKeys(KEYS)
    assert not any(k in repr(keys) or k in str(vars(keys)) for k in KEYS) and "2 keys" in repr(keys)
    line = access_line("127.0.0.1", keys, open_paths())
    assert (
        "2 keys from --api-key" in line
        and "/health, /metrics" in line
        and not any(k in line for k in KEYS)
    )
    assert "/metrics" not in access_line("127.0.0.1", keys, open_paths(metrics_require_key=True))


def test_the_comparison_is_constant_time_against_every_key(monkeypatch):
    """hmac.compare_digest on SHA-256 digests (equal lengths: the time says nothing of the key's length), called
    once per key whether the first, the last or no key matches: no early exit."""
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(
        auth.hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b)
    )
    keys = ApiKeys(["first", "middle", "last"])
    for presented, expected in (
        ("first", True),
        ("last", True),
        ("nope", False),
        (None, False),
        ("", False),
    ):
        calls.clear()
        assert keys.accepts(presented) is expected
        assert calls == [(32, 32)] * 3, (presented, calls)


@pytest.mark.parametrize(
    "header, token",
    [
        ("Bearer k", "k"),
        ("bearer k", "k"),
        ("BEARER  k ", "k"),
        ("Bearer", None),
        ("Basic k", None),
        ("k", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


# ---- the warning for a server anyone may reach ------------------------------------------------------------------
@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("192.168.1.20", False),
        ("fe80::1%eth0", False),
        ("example.com", False),
        ("128.0.0.1", False),
    ],
)
def test_which_hosts_are_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_the_warning_is_for_a_reachable_server_without_a_key():
    warning = access_line("0.0.0.0", None, open_paths())
    assert warning.startswith("[serve] warning: ") and "0.0.0.0" in warning and "\n" not in warning
    assert "--api-key" in warning and auth.ENV_VAR in warning
    assert (
        access_line("127.0.0.1", None, open_paths()) is None
        and access_line("localhost", None, open_paths()) is None
    )
    assert "warning" not in access_line("0.0.0.0", ApiKeys(["k"]), open_paths())


def test_the_cli_prints_the_warning_once_for_a_host_beyond_loopback(tiny_qwen2):
    """192.0.2.1 (TEST-NET-1, documentation only) is no address of this machine: the server warns, then cannot
    bind it and exits, so nothing ever listens beyond loopback."""
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssd_engine.serve",
            "--model",
            tiny_qwen2,
            "--host",
            "192.0.2.1",
            "--port",
            "0",
        ],
        cwd=REPO_ROOT,
        env={**env, "SSD_ENGINE_PROGRESS": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    warnings = [
        line for line in done.stderr.splitlines() if "warning" in line and "API key" in line
    ]
    assert len(warnings) == 1 and "192.0.2.1" in warnings[0], done.stderr
    assert done.returncode == 3, done.stderr  # uvicorn could not bind it


def test_the_cli_refuses_metrics_require_key_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
    done = subprocess.run(
        [sys.executable, "-m", "ssd_engine.serve", "--metrics-require-key", "--port", "0"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.strip().startswith(
        "error: --metrics-require-key needs an API key"
    )


# ---- the CLI: flags, the variable, and logs with no key in them --------------------------------------------------
def test_cli_repeated_flags_and_metrics_require_key_and_no_key_in_the_logs(tiny_qwen2):
    env_key = "sk-test-envonly-5a2b"  # the flag wins: this key is not accepted
    served = Served(
        tiny_qwen2,
        "--api-key",
        KEYS[0],
        "--api-key",
        KEYS[1],
        "--metrics-require-key",
        env={auth.ENV_VAR: env_key},
    )
    try:
        port = served.port
        access = [line for line in served.before_start if "API key" in line]
        assert (
            len(access) == 1
            and "2 keys from --api-key" in access[0]
            and "/metrics" not in access[0]
        ), access
        for key in (WRONG, env_key):
            with pytest.raises(openai.AuthenticationError):
                client(port, key).completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert (
            client(port, KEYS[0])
            .completions.create(model=NAME, prompt="hi", max_tokens=2)
            .usage.total_tokens
        )
        stream = client(port, KEYS[1]).completions.create(
            model=NAME, prompt="hi", max_tokens=2, stream=True
        )
        assert [c for c in stream][-1].choices[0].finish_reason is not None
        assert_401(*get(port, "/metrics"), "no API key")
        assert get(port, "/metrics", {"Authorization": f"Bearer {KEYS[1]}"})[0] == 200
        assert get(port, "/health")[0] == 200
    finally:
        said = served.stop()
    assert "POST /v1/completions" in said and " 401" in said  # the access log was captured
    assert not any(key in said for key in (*KEYS, WRONG, env_key)), said


def test_cli_the_environment_variable_route(tiny_qwen2):
    served = Served(tiny_qwen2, env={auth.ENV_VAR: KEYS[1]})
    try:
        port = served.port
        access = [line for line in served.before_start if "API key" in line]
        assert len(access) == 1 and f"1 key from {auth.ENV_VAR}" in access[0], access
        with pytest.raises(openai.AuthenticationError):
            client(port, WRONG).chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "hi"}]
            )
        assert_401(*get(port, "/v1/models"), "no API key")
        stream = client(port, KEYS[1]).completions.create(
            model=NAME, prompt="hi", max_tokens=2, stream=True
        )
        assert [c for c in stream][-1].choices[0].finish_reason is not None
        assert get(port, "/metrics")[0] == 200 and get(port, "/health")[0] == 200  # open by default
    finally:
        said = served.stop()
    assert "POST /v1/completions" in said and not any(key in said for key in (*KEYS, WRONG)), said
