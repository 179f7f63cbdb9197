"""Fast backup speculators without a model: n-gram prompt lookup, else random tokens. Their
proposals were not sampled from a distribution, so they are verified as q = one-hot."""

import torch


def ngram_proposal(tokens: list[int], k: int, max_n: int = 3) -> list[int] | None:
    """The K tokens after the latest earlier match of the longest suffix (<= max_n), or None."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return (follow + follow[-1:] * k)[
                        :k
                    ]  # pad a short continuation with its last token
    return None


def random_proposal(k: int, vocab: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (k,), generator=generator, device=generator.device).tolist()


def fast_proposal(
    tokens: list[int], k: int, vocab: int, generator: torch.Generator, max_n: int = 3
) -> list[int]:
    return ngram_proposal(tokens, k, max_n) or random_proposal(k, vocab, generator)
