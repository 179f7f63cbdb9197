"""RequestOutput.logprobs ({token id: log-probability} per token, the chosen one first) in OpenAI's two
shapes: the completions API's parallel lists and the chat API's `content` entries. A token a filter
removed (-inf) is sent as -9999.0, as vLLM does: JSON has no infinity."""

from __future__ import annotations

import math

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer, entries: list[dict[int, float]], top: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for entry in entries:
        chosen, logprob = next(iter(entry.items()))
        text = _text(tokenizer, chosen)
        tokens.append(text)
        values.append(_value(logprob))
        offsets.append(offset)
        offset += len(text)
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
        texts: dict[str, float] = {}
        # two ids may decode alike (a partial UTF-8 byte): the likelier one's value
        for (
            token,
            value,
        ) in ranked:
            texts.setdefault(_text(tokenizer, token), _value(value))
        tops.append(texts if top else None)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, entries: list[dict[int, float]], top: int) -> dict:
    def described(token: int, logprob: float) -> dict:
        text = _text(tokenizer, token)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}

    content = []
    for entry in entries:
        chosen, logprob = next(iter(entry.items()))
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
        content.append(
            {**described(chosen, logprob), "top_logprobs": [described(t, v) for t, v in ranked]}
        )
    return {"content": content, "refusal": None}
