"""Stop strings (OpenAI's `stop`, vLLM's `SamplingParams.stop`): text that ends an answer.

A stop string can span tokens or sit inside one, so it is looked for in the decoded text, on
the host, after each chunk of tokens: the programs never see it. Offline `generate` and the
server cut the same way (the answer's text ends right before the string, or right after it with
`include_stop_str_in_output`), and both hold back, while a row runs, the tail of the text that
may be the start of a stop string, so streamed text is never taken back.
"""
from __future__ import annotations

from typing import Callable, Sequence


def find(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text`: (where it starts, the string), the longest one
    where two start at the same place; None when none is there."""
    hits = [(i, -len(s), s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return None
    i, _, s = min(hits)
    return i, s


def cut(text: str, stops: Sequence[str], include: bool = False) -> str | None:
    """`text` ended at its first stop string (the string kept when `include`); None when no
    stop string is there."""
    hit = find(text, stops)
    if hit is None:
        return None
    i, s = hit
    return text[:i + len(s)] if include else text[:i]


def kept(tokens: list[int], since: int, decode: Callable[[list[int]], str],
         stops: Sequence[str]) -> int:
    """How many of an answer's tokens it keeps once its text holds a stop string that the
    first `since` tokens' text did not: up to the token that completed the string."""
    return next(j for j in range(since + 1, len(tokens) + 1)
                if find(decode(tokens[:j]), stops) is not None)


def shown(text: str, stops: Sequence[str]) -> str:
    """What of a running answer's text can be shown now: without a trailing incomplete
    character (U+FFFD: its next bytes may still come) and without the longest tail that a
    stop string starts with (the string may be completing)."""
    text = text[:-1] if text.endswith("\ufffd") else text
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return text[:len(text) - held]
