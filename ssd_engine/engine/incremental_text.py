"""One sequence's output text as it grows, for streaming, decoding only a tail of tokens per call.

Appending tokens changes only the text's last few characters, and a tail's decode differs from the
whole text's only in its first few; UNTRUSTED_CHARS bounds both. Where the tail's overlap with the
old text does not match, the whole output is decoded, so the result is the whole output's decode."""

from ssd_engine.engine.output_processor import UNTRUSTED_CHARS


class IncrementalText:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens = 0  # output tokens `text` was decoded from
        self.text = ""

    def of(self, ids: list[int]) -> str:
        """The text of `ids`, the sequence's output tokens (extending the last call's list)."""
        if len(ids) != self.tokens:
            text = self._extended(ids)
            self.tokens, self.text = len(ids), text if text is not None else self._decode(ids)
        return self.text

    def _extended(self, ids: list[int]) -> str | None:
        """The text of `ids` from the last call's and a tail's decode; None where the whole output must
        be decoded (a short one, or a tail whose overlap does not match)."""
        old, start, untrusted = self.text, self.tokens, UNTRUSTED_CHARS
        # short, or not an extension of the last call's
        if len(old) < 4 * untrusted or len(ids) < start:
            return None
        # tokens of the tail before the old end: enough for 3 x untrusted characters
        width = 2 * untrusted
        while True:
            if width >= start:
                return None
            old_tail = self._decode(ids[start - width : start])
            if len(old_tail) >= 3 * untrusted:
                break
            width *= 2
        new_tail = self._decode(ids[start - width :])
        # old_tail[:keep] lies before the characters the new tokens may change
        keep = len(old_tail) - untrusted
        if not (
            old.endswith(old_tail[untrusted:keep], 0, len(old) - untrusted)
            and new_tail.startswith(old_tail[:keep])
        ):
            return None
        return old[: len(old) - untrusted] + new_tail[keep:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
