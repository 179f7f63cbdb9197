"""A draft's prompt window (`draft_prompt_window`): the draft reads a long prompt's first SINK tokens
(attention sinks) and its last `window`, never the span between. A draft's context never changes the
output, only acceptance. Draft positions run on past the skipped span: RoPE scores depend on
positions' differences only, so the draft attends as if the text between were not there. SD's draft
(sd.py `DraftView`) and SSD's (its coordinator sends the draft process the windowed prompt) share it."""

SINK = 4
# a prompt's last tokens a CPU draft reads by default: most of what a shorter read saves, for a little
# acceptance (the sizes compared: benchmarks/results/2026-11-27-request-draft-prompt-window.md)
CPU_PROMPT_WINDOW = 128


def resolve(option: int | None, draft_device: str, overlaps_target: bool) -> int | None:
    """The option resolved. Unset: CPU_PROMPT_WINDOW for a CPU draft whose prompt read the target
    waits for (SD's, a third of the target's prefill); the whole prompt (None) on a GPU, or where the
    read overlaps the target's prefill (SSD's draft on its own cores reads a prompt faster than the
    larger target does, so a window would only lower acceptance)."""
    if option is not None:
        return option
    return CPU_PROMPT_WINDOW if draft_device == "cpu" and not overlaps_target else None


def skipped_span(num_prompt_tokens: int, window: int | None) -> int:
    """How many prompt tokens after the first SINK the draft never reads."""
    return max(0, num_prompt_tokens - SINK - window) if window is not None else 0


def windowed(token_ids: list[int], skipped: int) -> list[int]:
    """The tokens a draft reads: `token_ids` without the `skipped` ones after the first SINK."""
    return token_ids[:SINK] + token_ids[SINK + skipped:] if skipped else list(token_ids)


def describe(window: int | None) -> str:
    return "the whole prompt" if window is None else f"a prompt's first {SINK} and last {window} tokens"
