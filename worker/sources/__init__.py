"""The text of an item: notes carry it in their row; files are read under the allowed roots,
URLs fetched safely, code read from its file (`worker/sources/files.py`, `urls.py`, `code.py`)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.errors import InvalidInput, KidxError, SourceUnavailable, input_failure
from worker.settings import FilesSettings, UrlSettings
from worker.store.items import Item


@dataclass
class Reader:
    """Where an item's text comes from, with the limits that apply (from the settings)."""

    files: FilesSettings = field(default_factory=FilesSettings)
    urls: UrlSettings = field(default_factory=UrlSettings)

    def text(self, item: Item, cancel: Callable[[], bool] | None = None) -> str:
        """The text to index for this item (for files and URLs, extracted again each time);
        `cancel` interrupts a URL's fetch while it waits on the server."""
        if item.unreadable:  # bytes a host wrote that are not text (worker.store.text)
            raise InvalidInput(item.unreadable)
        read = _READ.get(item.kind)
        if read is None:
            raise InvalidInput(f"item {item.id} has an unknown kind {item.kind!r}")
        try:
            return read(self, item, cancel)
        except KidxError:
            raise
        except Exception as e:
            # A source's own failure that no check above it named (a library's, Python's on
            # a host's odd path or a server's odd answer): this item's, never the whole run's
            # (a bare ValueError failed every item of a bulk run as a bug). Anything else (a
            # soft time limit) is an interruption and goes on up.
            if not input_failure(e, *_SOURCE_PACKAGES):
                raise
            why = f"{item.kind} {item.id}: cannot be read ({type(e).__name__}: {e})"
            if isinstance(e, OSError) and e.errno in _PASSING:
                raise SourceUnavailable(why) from e  # the process's or the disk's, for now
            raise InvalidInput(why) from e

    def _file(self, item: Item, cancel: Callable[[], bool] | None) -> str:
        from worker.sources.files import read_file

        return read_file(self._source(item), self.files)

    def _url(self, item: Item, cancel: Callable[[], bool] | None) -> str:
        from worker.sources.urls import fetch_url

        return fetch_url(self._source(item), self.urls, cancel=cancel).text

    def _code(self, item: Item, cancel: Callable[[], bool] | None) -> str:
        from worker.sources.code import read_code

        return read_code(self._source(item), self.files)

    @staticmethod
    def _source(item: Item) -> str:
        if not item.source:
            raise InvalidInput(f"item {item.id} is a {item.kind} without a source")
        return item.source


# Where each kind's text is read from: a note's is its row; the others', their source.
_READ: dict[str, Callable[[Reader, Item, Callable[[], bool] | None], str]] = {
    "note": lambda reader, item, cancel: item.content,
    "file": Reader._file,
    "url": Reader._url,
    "code": Reader._code,
}

# Whose exceptions reading a source may raise on what it was given (`input_failure`).
_SOURCE_PACKAGES = (
    "httpx",
    "httpcore",
    "h11",
    "h2",
    "idna",
    "socket",
    "ssl",
    "zlib",
    "zipfile",
    "brotli",
    "zstandard",
    "trafilatura",
    "lxml",
    "justext",
    "htmldate",
    "courlan",
    "charset_normalizer",
    "xml",
    "docx",
    "pypdf",
    "cryptography",
    "PIL",
    "pathspec",
    "re2",
    "markdown_it",
    "codecs",
    "encodings",
)

# OS errors that say the process or the machine is short of something now, not that the source
# is wrong: retried later (SourceUnavailable), not failed for good.
_PASSING = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EIO, errno.EAGAIN, errno.ESTALE, errno.EINTR}
)
