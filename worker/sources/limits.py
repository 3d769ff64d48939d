"""What every converter refuses the same way: a one-line `InvalidInput` naming the source,
and a text longer than the source's size limit (`TextBudget`, `check_text_size`)."""

from __future__ import annotations

from worker.errors import InvalidInput


def refuse(name: object, reason: str) -> InvalidInput:
    return InvalidInput(f"{name}: {reason}")


class TextBudget:
    """The characters extracted so far, refused as soon as they pass the limit: a small
    compressed file (deflated XML, a PDF's compressed streams) can hold a huge text, which
    would hold a worker for minutes and make a hundred thousand chunks. Refused rather than
    cut short, as an oversized file is: an index of part of a document would pass for whole."""

    def __init__(self, name: object, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.used = 0

    def take(self, chars: int) -> None:
        self.used += chars
        if self.used > self.limit:
            raise text_over_limit(self.name, self.limit)


def text_over_limit(name: object, limit: int) -> InvalidInput:
    return refuse(name, f"the text extracted is over the size limit of {limit} characters")


def check_text_size(text: str, name: object, limit: int) -> str:
    """`text`, refused when longer than `limit` characters (the source's size limit): no
    file or page gives more text than the largest plain text file allowed."""
    if len(text) > limit:
        raise text_over_limit(name, limit)
    return text
