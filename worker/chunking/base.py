"""The chunk every chunker returns, and the exact text the embedder is given for it."""

from __future__ import annotations

import enum
import hashlib
import re
from typing import NamedTuple

MAX_CHUNK_SIZE = 1500
MIN_CHUNK_SIZE = 200
OVERLAP_SIZE = 100
# The size the structural chunker aims for, within the bounds above: a section that fits stays
# whole, a longer one is cut into parts of at most about this size. Measured (bench/retrieval.py,
# the Chroma chunking benchmark, MiniLM, top 5): a smaller target raises IoU and lowers recall
# (300: recall 69.6, IoU 8.8; 650: 75.6, 6.55; 1500: 77.4, 3.7). 650 is nearest to the search's
# goal on both (recall 83, IoU 6.5: the best smaller of recall/83 and IoU/6.5, tied with 700,
# whose IoU is 6.3); edit locality stays at 1.00 chunk re-embedded per edit (bench/chunking.py).
TARGET_CHUNK_SIZE = 650
# Characters of a title, a heading path or a summary that go in front of every chunk sent to
# the embedder (KIDX_EMBEDDING__CONTEXT_CHARS): a 1 MB title would otherwise be sent once a
# chunk, and refused by a real provider chunk by chunk. What is stored is never cut.
CONTEXT_CHARS = 300
# How an item's `last_error` begins the note of a fallback (worker.pipeline writes it; the
# reconcile sweep finds it, and the item is asked of the chunk model again; `kidx status`
# counts it).
FELL_BACK = "LLM chunking fell back to structure: "


def clip(text: str, limit: int, *, keep_end: bool = False) -> str:
    """At most `limit` characters of `text`, an ellipsis where it was cut (at the start when
    `keep_end`: the deepest headings of a path are the most specific)."""
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1) :] if keep_end else text[: limit - 1] + "…"


class ChunkMethod(enum.StrEnum):
    """Which chunker produced a chunk (`ChunkMethod`, as a host's UI shows it)."""

    LLM = "llm"
    STRUCTURE = "structure"


class Chunk(NamedTuple):
    """A slice `text[start:end]` of an item's text, with the context the embedder needs.

    `fence_open` / `fence_close` are set only on the parts of a fenced block that alone exceeds
    the maximum: the embedder sees each part re-fenced, the stored content stays an exact slice.
    A NamedTuple rather than a frozen dataclass: as immutable, and four times cheaper to build
    (the chunker builds one per chunk of every text).
    """

    index: int
    start: int
    end: int
    content: str
    headings: tuple[str, ...] = ()
    method: ChunkMethod = ChunkMethod.STRUCTURE
    summary: str | None = None
    fence_open: str | None = None
    fence_close: str | None = None

    def embedding_input(self, title: str, context: int = CONTEXT_CHARS) -> str:
        """`title` (the pipeline gives none: a rename would re-embed every chunk), heading
        path, summary (each cut to `context` characters), then the (re-fenced) content: what
        is embedded."""
        path = clip(" > ".join(self.headings), context, keep_end=True)
        head = [line for line in (clip(title.strip(), context), path) if line]
        if self.summary:
            head.append(clip(self.summary, context))
        body = self.content
        if self.fence_open:  # (its info string cut too: a 300 KB one went into every part)
            body = f"{clip(self.fence_open, context)}\n{body}"
        if self.fence_close:
            body = f"{body}\n{self.fence_close}"
        return "\n".join(head) + "\n\n" + body if head else body


# A heading path as `note_chunks.headings` stores it: the titles joined by " > ". In a title,
# a `>` that a space (or the title's start) is before gets one more backslash in front (`>` is
# stored `\>`, `\>` is stored `\\>`), so that " > " is only ever the separator: a heading
# "When n > 0" came back from search as the two titles "When n" and "0".
_OPENS_SEPARATOR = re.compile(r"(?:^|(?<= ))(\\*)>")
_ESCAPED = re.compile(r"(?:^|(?<= ))\\(\\*)>")


def heading_path(titles: tuple[str, ...] | list[str]) -> str:
    """The stored form of a chunk's headings (`heading_titles` reads it back)."""
    return " > ".join(_OPENS_SEPARATOR.sub(lambda m: f"\\{m[1]}>", t) for t in titles)


def heading_titles(path: str) -> list[str]:
    """The titles of a stored heading path (written by `heading_path`, or by a host: a path
    with no escapes is split at each " > " as before)."""
    return [_ESCAPED.sub(lambda m: f"{m[1]}>", t) for t in path.split(" > ")] if path else []


def text_hash(text: str) -> str:
    """Stable hash of a text (content hashes, embedder-input hashes); the sha256 of its UTF-8.

    A long text is encoded a piece at a time: encoding allocates four bytes a character for a
    text with one emoji in it, 80 MB at once for a 20 MB note."""
    if len(text) <= _PIECE:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    h = hashlib.sha256()
    for i in range(0, len(text), _PIECE):  # surrogatepass encodes each surrogate alone: no seams
        h.update(text[i : i + _PIECE].encode("utf-8", "surrogatepass"))
    return h.hexdigest()


_PIECE = 1 << 20
