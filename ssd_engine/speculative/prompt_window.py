"""A draft's prompt window: the draft reads a long prompt's first SINK tokens and its last `window`,
never the span between; positions run on past it (RoPE depends on position differences only).
It changes acceptance only, never the output. Shared by SD (sd.py `DraftView`) and SSD."""

SINK = 4
# a CPU draft's default window: most of what a shorter read saves, for a little acceptance
CPU_PROMPT_WINDOW = 128


def resolve(option: int | None, draft_device: str, overlaps_target: bool) -> int | None:
    """The option resolved. Unset: CPU_PROMPT_WINDOW for a CPU draft whose prompt read the target
    waits for; else the whole prompt (None): an overlapped read's window only lowers acceptance."""
    if option is not None:
        return option
    return CPU_PROMPT_WINDOW if draft_device == "cpu" and not overlaps_target else None


def skipped_span(num_prompt_tokens: int, window: int | None) -> int:
    """How many prompt tokens after the first SINK the draft never reads."""
    return max(0, num_prompt_tokens - SINK - window) if window is not None else 0


def draft_length(n: int, skipped: int) -> int:
    """Draft positions covering a sequence's first n tokens."""
    return n if n <= SINK else max(SINK, n - skipped)


def windowed(
    token_ids: list[int], skipped: int, start: int = 0, end: int | None = None
) -> list[int]:
    """The tokens at draft positions [start, end) (end None: all): draft position i holds token i
    below SINK, else token i + skipped."""
    end = draft_length(len(token_ids), skipped) if end is None else end
    if not skipped:
        return token_ids[start:end]
    return token_ids[start : min(end, SINK)] + token_ids[max(start, SINK) + skipped : end + skipped]


def describe(window: int | None) -> str:
    return (
        "the whole prompt"
        if window is None
        else f"a prompt's first {SINK} and last {window} tokens"
    )
