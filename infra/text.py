"""Error text in one line: what every refusal and failure message quotes of another error or
value. Imports nothing of ppoflow, so any module can use it."""

from __future__ import annotations


def one_line(text: str, limit: int | None = None) -> str:
    """``text`` with each run of whitespace (newlines included) made one space; longer than
    ``limit`` characters, cut to that many with "..." at the end."""
    flat = " ".join(text.split())
    if limit is None or len(flat) <= limit:
        return flat
    return flat[: limit - 3] + "..."


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (cut to ``limit`` characters as `one_line` cuts), or
    its type's name when the message is empty."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return one_line(text.splitlines()[0], limit)


def error_text(exc: BaseException, limit: int | None = None) -> str:
    """``exc``'s whole message in one line (`one_line`), or its type's name when it is empty."""
    return one_line(str(exc), limit) or type(exc).__name__
