"""The OpenAI-compatible server, live on 127.0.0.1 (a kernel-picked port), through the official
`openai` client: greedy answers equal LLM.generate's, streams join to them and end with [DONE],
many concurrent streams neither lose nor duplicate tokens, a disconnecting client frees its
blocks, and bad requests get OpenAI-shaped errors."""
import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from ssd_engine import LLM, SamplingParams
from ssd_engine.server.async_engine import AsyncEngine
from ssd_engine.server.openai_api import build_app

PROMPTS = ["hello world", "def f(x):", "The quick brown fox", "1, 2, 3,"]
NAME = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=12)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def served(tiny_qwen2):
    llm = LLM(tiny_qwen2, max_num_seqs=8, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=12)
    offline = {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}
    offline["sampled"] = llm.generate([PROMPTS[3]], SamplingParams(**SAMPLED), use_tqdm=False)[0].text
    llm.tokenizer.chat_template = CHAT_TEMPLATE  # the byte-level test tokenizer ships none
    chat_prompt = llm.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    offline["chat"] = llm.generate([chat_prompt], params, use_tqdm=False)[0].text
    engine = AsyncEngine(llm, max_pending=64)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, NAME), log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    yield client, engine, offline, port
    server.should_exit = True
    thread.join(timeout=10)
    engine.close()
    llm.close()


def test_completion_equals_offline_generate(served):
    client, _, offline, _ = served
    for prompt in PROMPTS:
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == offline[prompt]
        assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 12


def test_stream_joins_to_the_same_text_and_carries_usage(served):
    client, _, offline, _ = served
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == offline[PROMPTS[1]]
    assert chunks[-1].choices[0].finish_reason is not None and chunks[-1].usage.total_tokens > 0
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_request_not_streamed_gets_one_delta_and_is_not_decoded_while_it_runs(served, monkeypatch):
    """A streamed request's text is decoded after every step (engine/incremental_text.py); a request
    not streamed needs none of it until it finishes."""
    from ssd_engine.engine.incremental_text import IncrementalText
    _, engine, offline, _ = served
    decoded = []
    monkeypatch.setattr(IncrementalText, "of", lambda self, ids, of=IncrementalText.of: decoded.append(ids) or of(self, ids))
    params = SamplingParams(temperature=0, max_tokens=12)

    async def deltas(stream: bool) -> list:
        return [d async for d in engine.generate(PROMPTS[1], params, stream=stream)]
    whole = asyncio.run(deltas(False))
    assert decoded == []
    streamed = asyncio.run(deltas(True))
    assert len(whole) == 1 and whole[0].output is not None and whole[0].text == offline[PROMPTS[1]]
    assert decoded and "".join(d.text for d in streamed) == whole[0].text


def test_chat_uses_the_template_and_streams_deltas(served):
    client, _, offline, _ = served
    out = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert out.choices[0].message.content == offline["chat"] and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == offline["chat"]
    assert chunks[0].choices[0].delta.role == "assistant"  # OpenAI's first delta names the role, once
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_seeded_sampling_reproduces_the_offline_sample(served):
    client, _, offline, _ = served
    for _ in range(2):
        out = client.completions.create(model=NAME, prompt=PROMPTS[3], **{k: v for k, v in SAMPLED.items() if k != "top_k"},
                                        extra_body={"top_k": SAMPLED["top_k"]})
        assert out.choices[0].text == offline["sampled"]


def test_stop_string(served):
    client, _, offline, _ = served
    text = offline[PROMPTS[0]]
    stop = text[4:6]
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == text[:text.find(stop)] and out.choices[0].finish_reason == "stop"


def test_concurrent_streams_each_complete_exactly(served):
    client, engine, offline, port = served
    async_client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

    async def one(prompt):
        stream = await async_client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                       stream=True)
        return prompt, "".join([c.choices[0].text async for c in stream])

    async def quitter():  # reads one chunk, then disconnects while the others stream
        stream = await async_client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=300, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()

    async def all_of_them():
        jobs = [one(PROMPTS[i % 4]) for i in range(32)]
        return await asyncio.wait_for(asyncio.gather(quitter(), *jobs), timeout=120)
    free = engine.engine.block_manager.num_free_blocks
    _, *results = asyncio.run(all_of_them())
    assert len(results) == 32
    for prompt, text in results:
        assert text == offline[prompt]
    deadline = time.time() + 30
    while engine.engine.has_unfinished() or engine.engine.block_manager.num_free_blocks != free:
        assert time.time() < deadline, "blocks did not return to the pool"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_blocks(served):
    _, engine, _, port = served
    free, aborted = engine.engine.block_manager.num_free_blocks, engine.aborted
    body = json.dumps({"model": NAME, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=30)
    response.readline()  # the first chunk arrived: the request is running
    assert engine.engine.has_unfinished() and engine.engine.block_manager.num_free_blocks < free
    response.close()     # the client goes away
    deadline = time.time() + 30
    while engine.engine.block_manager.num_free_blocks != free or engine.engine.has_unfinished():
        assert time.time() < deadline, "the disconnected request's blocks never came back"
        time.sleep(0.05)
    assert engine.aborted == aborted + 1


def _post(port, path, raw: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", raw, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("raw, status, needle", [
    (b'{"model": "tiny", "prompt": "x"', 400, "malformed JSON"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "'other' does not exist"),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": NAME, "prompt": "x", "logprobs": 2}).encode(), 400, "unsupported field 'logprobs'"),
    (json.dumps({"model": NAME, "prompt": "x", "n": 2}).encode(), 400, "'n'"),
    (json.dumps({"model": NAME, "prompt": "x " * 2000, "max_tokens": 4}).encode(), 400, "more than max_model_len"),
], ids=["malformed-json", "unknown-model", "bad-temperature", "unsupported-field", "n-2", "prompt-too-long"])
def test_bad_requests_get_openai_shaped_errors(served, raw, status, needle):
    _, _, _, port = served
    code, body = _post(port, "/v1/completions", raw)
    assert code == status and needle in body["error"]["message"], body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    code, body = _post(port, "/v1/completions", json.dumps({"model": NAME, "prompt": "ok", "max_tokens": 2}).encode())
    assert code == 200  # the server still answers


def test_models_and_health(served):
    client, _, _, port = served
    assert [m.id for m in client.models.list()] == [NAME]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}


def test_serve_cli_starts_answers_and_stops_cleanly(tiny_qwen2):
    import os
    import re
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "ssd_engine.serve", "--model", tiny_qwen2, "--port", "0",
                             "--served-model-name", "cli-tiny"], stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.time() + 120
        while port is None and time.time() < deadline:
            line = proc.stderr.readline()
            if match := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
        assert port, "the server never said where it listens"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model="cli-tiny", prompt="hi", max_tokens=3).usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    assert not os.path.exists(f"/proc/{proc.pid}")


def test_metrics_count_requests_tokens_and_errors(served):
    client, _, _, port = served
    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            lines = response.read().decode().splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}
    before = scrape()
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    _post(port, "/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode())
    after = scrape()
    assert after['ssd_requests_total{finish_reason="length"}'] - before.get('ssd_requests_total{finish_reason="length"}', 0) == 1
    assert after["ssd_generation_tokens_total"] - before.get("ssd_generation_tokens_total", 0) == 5
    assert after['ssd_rejected_requests_total{status="404"}'] - before.get('ssd_rejected_requests_total{status="404"}', 0) == 1
    assert after["ssd_time_to_first_token_seconds_count"] - before.get("ssd_time_to_first_token_seconds_count", 0) == 1
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].usage is not None
    # a stream read to its end is not an abort; the request is counted once it finished
    assert scrape()["ssd_aborted_requests_total"] == after["ssd_aborted_requests_total"]
    for name in ("ssd_spec_acceptance_rate", "ssd_cache_hit_rate", "ssd_draft_failures_total", "ssd_aborted_requests_total"):
        assert name in after


def test_past_the_pending_limit_requests_are_refused_not_queued(tiny_qwen2):
    from ssd_engine.server.async_engine import Overloaded
    with LLM(tiny_qwen2, max_num_seqs=2, num_kv_blocks=64) as llm:
        engine = AsyncEngine(llm, max_pending=1)
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

        async def scenario():
            first = engine.generate("hello", params)
            await anext(first)  # in flight
            with pytest.raises(Overloaded, match="limit 1"):
                await anext(engine.generate("again", params))
            await first.aclose()  # the reader goes away: aborted, its slot is free again
            short = [d async for d in engine.generate("again", SamplingParams(temperature=0, max_tokens=3))]
            return short[-1].output
        output = asyncio.run(scenario())
        assert output.metrics.num_output_tokens == 3 and engine.aborted == 1
        engine.close()


def test_ssd_behind_the_server_gives_the_target_greedy_output(tiny_qwen2, tmp_path):
    import sys
    import os
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_checkpoints import build_checkpoint
    draft = build_checkpoint(str(tmp_path / "draft"), "qwen2", seed=0, num_hidden_layers=1)
    params = SamplingParams(temperature=0, max_tokens=10)
    with LLM(tiny_qwen2, max_num_seqs=4) as reference:
        offline = [o.text for o in reference.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(tiny_qwen2, draft_model=draft, speculative_mode="ssd", num_speculative_tokens=3, max_num_seqs=4,
             cpu_cores="0;1") as llm:
        engine = AsyncEngine(llm)

        async def one(prompt):
            return "".join([d.text async for d in engine.generate(prompt, params)])

        async def all_of_them():
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        assert asyncio.run(all_of_them()) == offline
        assert llm.speculation_metrics()["rounds"] > 0
        engine.close()


def test_overload_is_a_503_in_openai_shape(tiny_qwen2):
    from fastapi.testclient import TestClient
    with LLM(tiny_qwen2, max_num_seqs=2, num_kv_blocks=32) as llm:
        engine = AsyncEngine(llm, max_pending=0)  # every request is one too many
        with TestClient(build_app(engine, NAME)) as http:
            response = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "server_overloaded" and "limit 0" in response.json()["error"]["message"]
            assert http.get("/health").json() == {"status": "ok"}
        engine.close()
