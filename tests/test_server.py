"""The OpenAI-compatible server, live on 127.0.0.1 (a kernel-picked port), through the official
`openai` client: greedy answers equal LLM.generate's, streams join to them and end with [DONE],
many concurrent streams neither lose nor duplicate tokens, a disconnecting client frees its
blocks, and bad requests get OpenAI-shaped errors."""

import asyncio
import json
import re
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
PENALISED = dict(
    presence_penalty=0.5,
    frequency_penalty=0.3,
    logit_bias={40: 3.0},
    repetition_penalty=1.2,
    min_tokens=6,
)


@pytest.fixture(scope="module")
def served(tiny_qwen2):
    llm = LLM(tiny_qwen2, max_num_seqs=8, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=12)
    offline = {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}
    offline["sampled"] = llm.generate([PROMPTS[3]], SamplingParams(**SAMPLED), use_tqdm=False)[
        0
    ].text
    llm.tokenizer.chat_template = CHAT_TEMPLATE  # the byte-level test tokenizer ships none
    chat_prompt = llm.tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    offline["chat"] = llm.generate([chat_prompt], params, use_tqdm=False)[0].text
    # computed before the server's loop owns the engine: one thread steps an engine, never two
    offline["penalised"] = llm.generate(
        [PROMPTS[0]], SamplingParams(**PENALISED, temperature=0, max_tokens=8), use_tqdm=False
    )[0].text
    offline["logprobs"] = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False
    )[0].logprobs
    engine = AsyncEngine(llm, max_pending=64)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # keep-alive past any gap between tests: the shared client reuses its idle connection, and one
    # closed by the server's 5 s default as a request went out failed as "server disconnected"
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine, NAME), log_level="warning", timeout_keep_alive=600)
    )
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
        assert (
            out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 12
        )


def test_stream_joins_to_the_same_text_and_carries_usage(served):
    client, _, offline, _ = served
    chunks = list(
        client.completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == offline[PROMPTS[1]]
    assert chunks[-1].choices[0].finish_reason is not None and chunks[-1].usage.total_tokens > 0
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_request_not_streamed_gets_one_delta_and_is_not_decoded_while_it_runs(
    served, monkeypatch
):
    """A streamed request's text is decoded after every step (engine/incremental_text.py); a request
    not streamed needs none of it until it finishes."""
    from ssd_engine.engine.incremental_text import IncrementalText

    _, engine, offline, _ = served
    decoded = []
    monkeypatch.setattr(
        IncrementalText,
        "of",
        lambda self, ids, of=IncrementalText.of: decoded.append(ids) or of(self, ids),
    )
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
    assert (
        out.choices[0].message.content == offline["chat"]
        and out.choices[0].message.role == "assistant"
    )
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == offline["chat"]
    assert (
        chunks[0].choices[0].delta.role == "assistant"
    )  # OpenAI's first delta names the role, once
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_seeded_sampling_reproduces_the_offline_sample(served):
    client, _, offline, _ = served
    for _ in range(2):
        out = client.completions.create(
            model=NAME,
            prompt=PROMPTS[3],
            **{k: v for k, v in SAMPLED.items() if k != "top_k"},
            extra_body={"top_k": SAMPLED["top_k"]},
        )
        assert out.choices[0].text == offline["sampled"]


def test_stop_string(served):
    client, _, offline, _ = served
    text = offline[PROMPTS[0]]
    stop = text[4:6]
    out = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == text[: text.find(stop)] and out.choices[0].finish_reason == "stop"


def test_concurrent_streams_each_complete_exactly(served):
    client, engine, offline, port = served
    async_client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
    )

    async def one(prompt):
        stream = await async_client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return prompt, "".join([c.choices[0].text async for c in stream])

    async def quitter():  # reads one chunk, then disconnects while the others stream
        stream = await async_client.completions.create(
            model=NAME,
            prompt=PROMPTS[2],
            max_tokens=300,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
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
    body = json.dumps(
        {
            "model": NAME,
            "prompt": PROMPTS[2],
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    response = urllib.request.urlopen(request, timeout=30)
    response.readline()  # the first chunk arrived: the request is running
    assert engine.engine.has_unfinished() and engine.engine.block_manager.num_free_blocks < free
    response.close()  # the client goes away
    deadline = time.time() + 30
    while engine.engine.block_manager.num_free_blocks != free or engine.engine.has_unfinished():
        assert time.time() < deadline, "the disconnected request's blocks never came back"
        time.sleep(0.05)
    assert engine.aborted == aborted + 1


def _post(port, path, raw: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", raw, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _body(**fields) -> bytes:
    return json.dumps({"model": NAME, "prompt": "x", **fields}).encode()


@pytest.mark.parametrize(
    "raw, status, needle, param",
    [
        (b'{"model": "tiny", "prompt": "x"', 400, "malformed JSON", None),
        (
            json.dumps({"model": "other", "prompt": "x"}).encode(),
            404,
            "'other' does not exist",
            "model",
        ),
        (_body(temperature=-1), 400, "temperature", "temperature"),
        (_body(best_of=2), 400, "unsupported field 'best_of'", "best_of"),
        (_body(logprobs=21), 400, "logprobs must be an int in [0, 20]", "logprobs"),
        (_body(n=0), 400, "n must be an int >= 1", "n"),
        (
            json.dumps({"model": NAME, "prompt": "x " * 2000, "max_tokens": 4}).encode(),
            400,
            "more than max_model_len",
            "prompt",
        ),
        (
            _body(stream_options={"include_usage": True}),
            400,
            "stream_options is only allowed with stream: true",
            "stream_options",
        ),
        (
            _body(max_completion_tokens=0),
            400,
            "max_completion_tokens must be an int > 0",
            "max_completion_tokens",
        ),
        (_body(max_tokens=0), 400, "max_tokens must be an int > 0", "max_tokens"),
        (_body(min_p=2), 400, "min_p must be in [0, 1]", "min_p"),
        (_body(top_p=0), 400, "top_p must be in (0, 1]", "top_p"),
        (_body(presence_penalty=3), 400, "presence_penalty must be in [-2, 2]", "presence_penalty"),
        (
            _body(logit_bias={"99999": 1}),
            400,
            "token id 99999 is outside the vocabulary",
            "logit_bias",
        ),
        (_body(logit_bias={"x": 1}), 400, "logit_bias keys must be token ids", "logit_bias"),
        (
            _body(stream=True, stream_options={"include_obfuscation": True}),
            400,
            "unsupported field 'stream_options.include_obfuscation'",
            "stream_options.include_obfuscation",
        ),
    ],
    ids=[
        "malformed-json",
        "unknown-model",
        "bad-temperature",
        "unsupported-field",
        "logprobs-21",
        "n-0",
        "prompt-too-long",
        "stream-options-without-stream",
        "max-completion-tokens-0",
        "max-tokens-0",
        "bad-min-p",
        "bad-top-p",
        "bad-presence-penalty",
        "bias-outside-the-vocabulary",
        "bias-key-not-an-id",
        "unsupported-stream-option",
    ],
)
def test_bad_requests_get_openai_shaped_errors(served, raw, status, needle, param):
    """One line each, naming the field at fault in the message and as OpenAI's `param`."""
    _, _, _, port = served
    code, body = _post(port, "/v1/completions", raw)
    assert code == status and needle in body["error"]["message"], body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "\n" not in body["error"]["message"] and body["error"]["param"] == param, body
    code, body = _post(
        port,
        "/v1/completions",
        json.dumps({"model": NAME, "prompt": "ok", "max_tokens": 2}).encode(),
    )
    assert code == 200  # the server still answers


def test_penalties_bias_and_min_tokens_reach_the_engine(served):
    """OpenAI's fields and vLLM's extra body fields give what LLM.generate gives with the same values."""
    client, engine, offline, _ = served
    fields = dict(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"40": 3.0})
    extra = dict(repetition_penalty=1.2, min_tokens=6)
    out = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body=extra, **fields
    )
    assert out.choices[0].text == offline["penalised"]
    chat = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=4, temperature=0, logit_bias={"41": 100}
    )
    assert chat.choices[0].message.content == engine.llm.tokenizer.decode(
        [41] * 4
    )  # a +100 bias wins every step


def test_logprobs_in_both_apis_streamed_and_not(served):
    client, _, offline, _ = served
    out = client.completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2
    )
    got = out.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(
        [next(iter(e.values())) for e in offline["logprobs"]], abs=1e-5
    )
    # greedy: the chosen token is the top one (two ids may decode alike: the legacy shape keys by text)
    assert all(
        1 <= len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-6)
        for top, lp in zip(got.top_logprobs, got.token_logprobs)
    )
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2, stream=True
        )
        if c.choices
    ]
    assert sum((c.token_logprobs for c in streamed if c), []) == pytest.approx(
        got.token_logprobs, abs=1e-6
    )
    chat = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(
        len(c.top_logprobs) == 3 for c in content
    )
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    plain = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    code, body = _post(
        served[3],
        "/v1/chat/completions",
        json.dumps({"model": NAME, "messages": CHAT, "top_logprobs": 2}).encode(),
    )
    assert code == 400 and body["error"]["param"] == "top_logprobs"


def test_n_samples_come_back_as_choices(served):
    client, _, offline, _ = served
    out = client.completions.create(
        model=NAME,
        prompt=PROMPTS[3],
        n=3,
        **{k: v for k, v in SAMPLED.items() if k != "top_k"},
        extra_body={"top_k": SAMPLED["top_k"]},
    )
    assert [c.index for c in out.choices] == [0, 1, 2] and out.choices[0].text == offline["sampled"]
    assert len({c.text for c in out.choices}) == 3  # each sample draws from a stream of its own
    chat = client.chat.completions.create(
        model=NAME, messages=CHAT, n=2, max_tokens=3, temperature=0
    )
    assert (
        len(chat.choices) == 2
        and chat.choices[0].message.content == chat.choices[1].message.content
    )


def test_n_samples_stream_interleaved_by_index(served):
    """Streamed, each chunk names its sample's index; joined per index they are the samples not streamed,
    each ends once, and the usage counts them all."""
    client, _, _, _ = served
    sampled = dict(prompt=PROMPTS[3], n=3, **{k: v for k, v in SAMPLED.items() if k != "top_k"})
    whole = client.completions.create(model=NAME, **sampled)
    chunks = list(
        client.completions.create(
            model=NAME, stream=True, stream_options={"include_usage": True}, **sampled
        )
    )
    texts, ends = ["", "", ""], [0, 0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        ends[choice.index] += choice.finish_reason is not None
    assert texts == [c.text for c in whole.choices] and ends == [1, 1, 1]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    chat = list(
        client.chat.completions.create(
            model=NAME, messages=CHAT, n=2, max_tokens=3, temperature=0, stream=True
        )
    )
    roles = [
        c.choices[0].index for c in chat if c.choices and c.choices[0].delta.role == "assistant"
    ]
    assert sorted(roles) == [0, 1]  # each sample's first delta names the role


def test_structured_outputs_in_every_field_clients_send(served):
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and guided_* fields:
    each output matches; a spec that does not compile, or two specs at once, is a 400 naming the field."""
    client, _, _, port = served
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=NAME,
        messages=CHAT,
        max_tokens=60,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    assert isinstance(json.loads(chat.choices[0].message.content)["ok"], bool)
    out = client.completions.create(
        model=NAME,
        prompt=PROMPTS[1],
        max_tokens=120,
        temperature=0.8,
        seed=3,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert out.choices[0].finish_reason != "stop" or isinstance(
        json.loads(out.choices[0].text), dict
    )
    out = client.completions.create(
        model=NAME,
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out.choices[0].text)
    out = client.completions.create(
        model=NAME,
        prompt=PROMPTS[2],
        max_tokens=12,
        temperature=1.0,
        extra_body={"guided_choice": ["red", "green"]},
    )
    assert out.choices[0].text in ("red", "green")
    for fields, param in (
        (dict(guided_regex="[a-"), "guided_regex"),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}},
                }
            ),
            "response_format",
        ),
        (dict(guided_regex="a", guided_choice=["b"]), "guided_regex"),
        (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    ):
        code, body = _post(port, "/v1/completions", _body(**fields))
        assert (
            code == 400 and body["error"]["param"] == param and "\n" not in body["error"]["message"]
        ), body


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

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ssd_engine.serve",
            "--model",
            tiny_qwen2,
            "--port",
            "0",
            "--served-model-name",
            "cli-tiny",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "SSD_ENGINE_API_KEY"},
    )  # no key: open
    try:
        port = None
        deadline = time.time() + 120
        while port is None and time.time() < deadline:
            line = proc.stderr.readline()
            if match := re.search(r"running on http://127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
        assert port, "the server never said where it listens"
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        assert (
            client.completions.create(
                model="cli-tiny", prompt="hi", max_tokens=3
            ).usage.completion_tokens
            >= 1
        )
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
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines
            if line and line[0] != "#"
        }

    before = scrape()
    out = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5
    _post(port, "/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode())
    after = scrape()
    assert (
        after['ssd_requests_total{finish_reason="length"}']
        - before.get('ssd_requests_total{finish_reason="length"}', 0)
        == 1
    )
    assert after["ssd_generation_tokens_total"] - before.get("ssd_generation_tokens_total", 0) == 5
    assert (
        after['ssd_rejected_requests_total{status="404"}']
        - before.get('ssd_rejected_requests_total{status="404"}', 0)
        == 1
    )
    assert (
        after["ssd_time_to_first_token_seconds_count"]
        - before.get("ssd_time_to_first_token_seconds_count", 0)
        == 1
    )
    chunks = list(
        client.completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, stream=True
        )
    )
    assert chunks[-1].usage is not None
    # a stream read to its end is not an abort; the request is counted once it finished
    assert scrape()["ssd_aborted_requests_total"] == after["ssd_aborted_requests_total"]
    for name in (
        "ssd_spec_acceptance_rate",
        "ssd_cache_hit_rate",
        "ssd_draft_failures_total",
        "ssd_aborted_requests_total",
    ):
        assert name in after


def test_metrics_count_the_steps_by_the_k_each_drafted():
    from ssd_engine.server.metrics import ServerMetrics

    text = ServerMetrics().render({"steps_by_k": {0: 3, 1: 5}}, 0).decode()
    assert 'ssd_spec_steps_total{k="0"} 3.0' in text and 'ssd_spec_steps_total{k="1"} 5.0' in text


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
            short = [
                d
                async for d in engine.generate("again", SamplingParams(temperature=0, max_tokens=3))
            ]
            return short[-1].output

        output = asyncio.run(scenario())
        assert output.metrics.num_output_tokens == 3 and engine.aborted == 1
        engine.close()


def test_ssd_behind_the_server_gives_the_target_greedy_output(tiny_qwen2, tmp_path):
    from tiny_checkpoints import build_checkpoint

    draft = build_checkpoint(str(tmp_path / "draft"), "qwen2", seed=0, num_hidden_layers=1)
    params = SamplingParams(temperature=0, max_tokens=10)
    with LLM(tiny_qwen2, max_num_seqs=4) as reference:
        offline = [o.text for o in reference.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(
        tiny_qwen2,
        draft_model=draft,
        speculative_mode="ssd",
        num_speculative_tokens=3,
        max_num_seqs=4,
        cpu_cores="0;1",
    ) as llm:
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
            response = http.post(
                "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}
            )
            assert response.status_code == 503
            assert (
                response.json()["error"]["type"] == "server_overloaded"
                and "limit 0" in response.json()["error"]["message"]
            )
            assert http.get("/health").json() == {"status": "ok"}
        engine.close()


def test_max_completion_tokens_is_honoured_and_wins_over_max_tokens(served):
    """The chat API's newer name for max_tokens (what current OpenAI SDKs send); given both, vLLM takes it."""
    client, _, _, _ = served
    greedy = dict(temperature=0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(
        model=NAME, messages=CHAT, max_completion_tokens=5, **greedy
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    out = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=3, max_completion_tokens=6, **greedy
    )
    assert out.usage.completion_tokens == 6
    out = client.completions.create(
        model=NAME,
        prompt=PROMPTS[0],
        temperature=0,
        extra_body={"ignore_eos": True, "max_completion_tokens": 4},
    )
    assert out.usage.completion_tokens == 4


def test_chat_without_max_tokens_runs_to_the_end_of_max_model_len(served):
    """As in vLLM: a chat request that sets no limit may generate until the context is full."""
    client, engine, _, _ = served
    messages = [{"role": "user", "content": "x" * 480}]
    out = client.chat.completions.create(
        model=NAME, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == engine.engine.max_model_len and out.usage.completion_tokens > 0


def test_include_usage_sends_a_last_chunk_with_usage_and_no_choices(served):
    """OpenAI's shape: every content chunk has usage null, then one chunk with `choices: []` and the usage,
    then [DONE]; both endpoints."""
    client, _, offline, _ = served
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == offline[PROMPTS[1]]
    assert last.choices == [] and 0 < last.usage.completion_tokens <= 12
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens > 0
    assert (
        all(c.usage is None for c in content) and content[-1].choices[0].finish_reason is not None
    )
    chat = list(
        client.chat.completions.create(
            model=NAME,
            messages=CHAT,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat[:-1]) == offline["chat"]
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chat[:-1])
    # include_usage false: no usage at all; no stream_options: the last chunk carries it (this server's default)
    quiet = list(
        client.completions.create(
            model=NAME,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": False},
        )
    )
    assert all(c.usage is None for c in quiet) and all(c.choices for c in quiet)


def test_continuous_usage_stats_count_every_chunk(served):
    """vLLM's extension: with include_usage, each chunk carries the usage so far, the last the total."""
    client, _, offline, _ = served
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=PROMPTS[2],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == offline[PROMPTS[2]] and last.choices == []
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and 0 < counts[0] and counts[-1] == last.usage.completion_tokens
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}


def test_unset_sampling_fields_take_the_models_generation_config_everywhere(
    tiny_qwen2, tmp_path, capsys
):
    """One rule on the three entry points (vLLM's): a field a request leaves unset takes the model's
    generation_config.json value, else SamplingParams' default; a seeded request then gives the same tokens
    through LLM.generate, the server and the CLI, and temperature=0 is still greedy."""
    import shutil

    from fastapi.testclient import TestClient

    from ssd_engine.generate import main as generate_main

    model = str(tmp_path / "model")
    shutil.copytree(tiny_qwen2, model)
    with open(f"{model}/generation_config.json") as f:
        config = json.load(f)
    model_defaults = dict(temperature=0.7, top_p=0.9, top_k=30, min_p=0.02)
    with open(f"{model}/generation_config.json", "w") as f:
        json.dump({**config, "do_sample": True, **model_defaults}, f)
    prompt, seeded = PROMPTS[3], dict(seed=11, max_tokens=10, ignore_eos=True)
    with LLM(model, max_num_seqs=2, num_kv_blocks=64) as llm:
        defaults = llm.get_default_sampling_params()
        assert {name: getattr(defaults, name) for name in model_defaults} == model_defaults
        expected = llm.generate(prompt, SamplingParams(**model_defaults, **seeded), use_tqdm=False)[
            0
        ].text
        greedy = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
        )[0].text
        assert expected != greedy  # the defaults matter for this prompt
        received = []
        make_samples = llm.engine.make_samples
        llm.engine.make_samples = lambda p, params: (
            received.append(params) or make_samples(p, params)
        )
        llm.generate(
            prompt, use_tqdm=False
        )  # no params: the model's defaults, not SamplingParams()
        assert received[-1] == defaults
        del llm.engine.make_samples
        engine = AsyncEngine(llm)
        with TestClient(build_app(engine, NAME)) as http:
            answer = http.post(
                "/v1/completions", json={"model": NAME, "prompt": prompt, **seeded}
            ).json()
            assert answer["choices"][0]["text"] == expected
            answer = http.post(
                "/v1/completions",
                json={"model": NAME, "prompt": prompt, "temperature": 0, **seeded},
            ).json()
            assert answer["choices"][0]["text"] == greedy
        engine.close()
    capsys.readouterr()
    generate_main(
        [
            "--model",
            model,
            "--prompt",
            prompt,
            "--seed",
            "11",
            "--max-tokens",
            "10",
            "--ignore-eos",
            "--no-progress",
        ]
    )
    assert capsys.readouterr().out == expected + "\n"


def test_build_makes_the_engine_on_the_thread_that_steps_it_and_reports_a_failed_build(tiny_qwen2):
    """The serve CLI's shape: every torch call of the engine on one thread (one OpenMP worker pool), and a
    build that raises reaches the caller, with no loop left running."""
    built_on, stepped_on = [], set()

    def make_llm():
        built_on.append(threading.get_ident())
        llm = LLM(tiny_qwen2, max_num_seqs=2, num_kv_blocks=32)
        step = llm.engine.step

        def recorded_step():
            stepped_on.add(threading.get_ident())
            return step()

        llm.engine.step = recorded_step
        return llm

    engine = AsyncEngine.build(make_llm)
    try:

        async def one():
            return "".join(
                [
                    d.text
                    async for d in engine.generate(
                        PROMPTS[0], SamplingParams(temperature=0, max_tokens=4)
                    )
                ]
            )

        assert asyncio.run(one())
        assert stepped_on == set(built_on) and built_on[0] != threading.get_ident()
    finally:
        engine.close()
        engine.llm.close()

    def refused():
        raise ValueError("max_model_len must be positive")

    loops_before = {
        t for t in threading.enumerate() if t.name == "ssd-engine-loop"
    }  # other tests' servers
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncEngine.build(refused)
    assert {t for t in threading.enumerate() if t.name == "ssd-engine-loop"} <= loops_before
