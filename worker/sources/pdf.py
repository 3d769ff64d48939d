"""A PDF's text, with headings marked by font size, within a budget of the work reading it
takes (`PdfWork`: a few KB of PDF can ask pypdf for an hour)."""

from __future__ import annotations

import io
import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

from worker.errors import ConfigError, InvalidInput, input_failure
from worker.settings import PDF_CONTENT_BYTES
from worker.sources.decoding import escape_markdown_lookalikes, normalize_newlines
from worker.sources.limits import TextBudget, check_text_size, refuse


def _font_size(tm: Any, cm: Any, size: float) -> float:
    """The rendered height: the font size scaled by the text and current matrices."""
    c = tm[2] * cm[0] + tm[3] * cm[2]
    d = tm[2] * cm[1] + tm[3] * cm[3]
    return round(size * (math.hypot(c, d) or 1.0), 1)


# What reading a page or a form costs besides its content, in bytes of content read in the
# same time: pypdf sets up its reading (0.3 ms) and each of its fonts (0.05 ms) again each
# time it reads the page or draws the form.
READ_COST = 250
FONT_COST = 50
# What pypdf's set-up of a font costs besides: each code of a `/ToUnicode` map's ranges (one
# line `<0000> <FFFF> <0041>` is 65,536 of them, 0.15 s at every page: a 10 KB PDF of 50 such
# fonts on 3 pages took 22 s and was charged 0.2% of the budget), and each name of an
# `/Encoding /Differences` array (99,000 of them: 7 ms a font a page).
MAP_COST = 2
NAMES_PER_BYTE = 16
# The most a stream may unpack to (pypdf's limits), at least: a small budget set for a test
# or a tight worker must not refuse a PDF whose object streams are a few MB.
UNPACKED_MIN = 8_000_000


def _bfranges(data: bytes) -> Iterator[bytes]:
    """What lies between each `beginbfrange` and the `endbfrange` after it, found in one pass:
    a lazy regex searched to the end from each opening that is never closed (quadratic: a
    1 KB map of 20,000 of them took 50 s)."""
    at = 0
    while (start := data.find(b"beginbfrange", at)) >= 0:
        end = data.find(b"endbfrange", start)
        if end < 0:
            return
        yield data[start + len(b"beginbfrange") : end]
        at = end + len(b"endbfrange")


_RANGE = re.compile(rb"<([0-9A-Fa-f]{1,8})>\s*<([0-9A-Fa-f]{1,8})>")


# Whose exceptions pypdf raises on a damaged file (`worker.errors.input_failure`); any other is
# an interruption (Celery's soft time limit), which must stop the run, not refuse the file.
_PDF_PACKAGES = ("pypdf", "zlib", "struct", "binascii", "codecs", "cryptography", "PIL")


def _damaged(e: Exception) -> bool:
    return input_failure(e, *_PDF_PACKAGES)


def _resolved(obj: Any) -> Any:
    return obj.get_object() if hasattr(obj, "get_object") else obj


class _PdfWork:
    """The work reading a PDF's text takes, refused once past `limit`, before the part that
    would pass it is read. pypdf bounds each stream (75 MB unpacked, 2 million tokens), but
    reads a page's content streams again for each page that draws them, a form's at each use
    (up to 5,000 a page), and sets up their fonts each time: a PDF of a few KB can take an
    hour (a stream of 1.6 million operators, 7 s to read, drawn by 500 pages). Counted in
    bytes of content unpacked, each time it is read, with `READ_COST` a read and `FONT_COST`
    a font: the time pypdf takes is about proportional (1.1 to 1.7 µs a byte, whatever the
    operators).

    The refusal is raised again at every operator after it: pypdf logs and skips an error in
    a form and goes on with the page."""

    def __init__(self, name: object, limit: int) -> None:
        self.name, self.limit = name, limit
        self.used = 0
        self.refusal: InvalidInput | None = None
        self.resources: list[Any] = []  # the resources of the page, then of each form drawn
        self.font_costs: dict[Any, int] = {}

    def charge(self, cost: int) -> None:
        self.check()
        self.used += cost
        if self.used > self.limit:
            self.refusal = refuse(
                self.name,
                f"reading its text means reading over {self.limit} bytes of page content "
                "(unpacked, each time a page or form draws it, fonts included); refused (a "
                "decompression bomb?)",
            )
            raise self.refusal

    def check(self) -> None:
        if self.refusal is not None:
            raise self.refusal

    def page(self, page: Any) -> None:
        """Charge the page's contents and fonts, before pypdf reads them."""
        try:
            contents = _resolved(page.get("/Contents"))
            resources = _resolved(page.get_inherited("/Resources", None))
        except Exception as e:  # damaged: pypdf says so when it reads it
            if not _damaged(e):
                raise
            contents = resources = None
        streams = contents if isinstance(contents, list) else [contents]
        self.resources = [resources]
        # Each charged as soon as it is unpacked, and none after the budget is spent: pypdf
        # keeps what it unpacked, and a 15 KB page of 40 streams of 70 MB each held 2.8 GB
        # before the sum of them was charged.
        self.charge(READ_COST)
        for stream in streams:
            self.charge(self._size(stream))
        self._charge_fonts(resources)

    def before(self, operator: bytes, operands: Any, _cm: Any, _tm: Any) -> None:
        """Before each operator: a form drawn (`Do`) is charged, its resources pushed."""
        self.check()
        if operator != b"Do":
            return
        form, resources = None, None
        try:  # as pypdf finds it: anything but an image is read as a form
            xobjects = _resolved(self.resources[-1].get("/XObject"))
            form = _resolved(xobjects[operands[0]])
            if form.get("/Subtype") not in (None, "/Image"):
                resources = _resolved(form.get_inherited("/Resources", None))
        except Exception as e:  # no such form: pypdf skips it too
            if not _damaged(e):
                raise
            form = None
        if resources is not None:
            self.charge(READ_COST)
            self.charge(self._size(form))
            self._charge_fonts(resources)
        self.resources.append(resources if resources is not None else {})

    def after(self, operator: bytes, _operands: Any, _cm: Any, _tm: Any) -> None:
        if operator == b"Do" and len(self.resources) > 1:
            self.resources.pop()

    @staticmethod
    def _size(stream: Any) -> int:
        """A content stream's bytes unpacked (pypdf keeps them: it does not unpack again)."""
        try:
            return len(_resolved(stream).get_data())
        except Exception as e:  # not a stream, or damaged: pypdf says so when it reads it
            if not _damaged(e):
                raise
            return 0

    def _charge_fonts(self, resources: Any) -> None:
        """Each font of `resources` charged as it is worked out (its map unpacked)."""
        try:
            fonts = _resolved(resources.get("/Font"))
            entries = [_resolved(font) for font in fonts.values()]
        except Exception as e:
            if not _damaged(e):
                raise
            return
        for font in entries:
            self.charge(self._font(font))

    def _font(self, font: Any) -> int:
        """A font's set-up, which pypdf does again at each page or form that uses it; worked
        out once a font."""
        ref = getattr(font, "indirect_reference", None)
        key = (ref.idnum, ref.generation) if ref is not None else id(font)
        if (known := self.font_costs.get(key)) is not None:
            return known
        cost = FONT_COST
        try:
            cmap = _resolved(font.get("/ToUnicode"))
            cost += self._size(cmap)
            if cmap is not None and hasattr(cmap, "get_data"):
                for block in _bfranges(cmap.get_data()):
                    for m in _RANGE.finditer(block):
                        first, last = int(m.group(1), 16), int(m.group(2), 16)
                        cost += MAP_COST * max(1, last - first + 1)
            encoding = _resolved(font.get("/Encoding"))
            if hasattr(encoding, "get") and encoding.get("/Differences") is not None:
                cost += len(_resolved(encoding["/Differences"])) // NAMES_PER_BYTE
        except Exception as e:
            if not _damaged(e):
                raise
        self.font_costs[key] = cost
        return cost


def _page_runs(
    page: Any, budget: TextBudget, work: _PdfWork
) -> tuple[str, list[tuple[float, str]]]:
    """A page's text, and its runs of text in one font size, in order. A run's pieces are
    joined once at the end: added to a string each time, they took time quadratic in their
    number (400,000 one-letter `Tj`: 2.6 s, against 0.03 s)."""
    runs: list[tuple[float, list[str]]] = []

    def visit(text: str, cm: Any, tm: Any, _font: Any, size: float) -> None:
        if not text:
            return
        budget.take(len(text))
        height = _font_size(tm, cm, size)
        if runs and (abs(runs[-1][0] - height) < 0.5 or not text.strip()):
            runs[-1][1].append(text)
        else:
            runs.append((height, [text]))

    work.page(page)
    text = page.extract_text(
        visitor_text=visit, visitor_operand_before=work.before, visitor_operand_after=work.after
    )
    work.check()  # a refusal pypdf swallowed (it goes on past an error in a form)
    return text or "", [(height, "".join(pieces)) for height, pieces in runs]


def _mark_headings(text: str, headings: dict[str, int]) -> str:
    """Lines whose whole text was set larger than the body become `#` headings; a heading
    wrapped over several lines becomes one. Other lines are escaped where they would read as
    Markdown structure (`escape_markdown_lookalikes`); a heading's are looked up as set."""
    out: list[str] = []
    previous = 0
    heading_at = -1  # where in `out` the last heading is: a blank line follows it
    for line in normalize_newlines(text).splitlines():
        level = headings.get(line.strip(), 0)
        if level and level == previous:
            out[heading_at] += " " + line.strip()
        elif level:
            out.extend(["", "#" * level + " " + line.strip(), ""])
            heading_at = len(out) - 2
        else:
            out.append(escape_markdown_lookalikes(line))
        previous = level
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def pdf_text(data: bytes, name: object, *, limit: int, max_content: int = PDF_CONTENT_BYTES) -> str:
    """A PDF's text, page by page with a blank line between; lines set in a font larger than
    the body's become Markdown headings, ranked by size. Refused once the text passes `limit`
    characters (the size limit), counted as it is extracted, or once reading it passes
    `max_content` bytes of page content (`_PdfWork`)."""
    import pypdf

    budget = TextBudget(name, limit)
    work = _PdfWork(name, max_content)
    # pypdf unpacks any stream up to 75 MB, those it reads before a page is charged too (the
    # object streams holding the pages: 250 bytes of flate over 70 MB of padding took 13 s);
    # no stream of more than the budget is read.
    unpacked = max(max_content, UNPACKED_MIN)
    limits = {
        f"{kind}_maximum_output_length": unpacked
        for kind in ("jbig2", "lzw", "run_length", "zlib", "brotli")
    }
    try:
        with pypdf.apply_configuration(
            maximum_declared_stream_length=unpacked,
            array_based_stream_maximum_output_length=unpacked,
            **limits,
        ):
            reader = pypdf.PdfReader(io.BytesIO(data))
            if reader.is_encrypted and not reader.decrypt(""):
                raise refuse(name, "the PDF is encrypted; give kidx a copy without a password")
            pages = [_page_runs(page, budget, work) for page in reader.pages]
    except InvalidInput:
        raise
    except pypdf.errors.LimitReachedError as e:
        raise refuse(
            name, f"a stream of it unpacks to over {unpacked} bytes ({e}); refused (a bomb?)"
        ) from None
    except pypdf.errors.DependencyError as e:  # the install's fault, not the file's
        raise ConfigError(
            f"{name}: reading this PDF needs a package that is not installed ({e}); install "
            "kidx's requirements again: pip install 'pypdf[crypto]'"
        ) from None
    except Exception as e:  # pypdf raises many kinds on damaged files
        if not _damaged(e):
            raise
        raise refuse(name, f"unreadable PDF ({type(e).__name__}: {e})".strip()) from None
    chars: Counter[float] = Counter()
    for _, runs in pages:
        for size, text in runs:
            chars[size] += len(text.strip())
    body = chars.most_common(1)[0][0] if chars else 0.0
    big = [
        {
            line.strip(): size
            for size, text in runs
            if size >= body * 1.15
            for line in text.splitlines()
            if 0 < len(line.strip()) <= 200
        }
        for _, runs in pages
    ]
    sizes = sorted({size for page in big for size in page.values()}, reverse=True)
    ranks = {size: min(i + 1, 6) for i, size in enumerate(sizes)}
    texts = [
        _mark_headings(text, {line: ranks[size] for line, size in lines.items()})
        for (text, _), lines in zip(pages, big)
    ]
    result = "\n\n".join(t for t in texts if t)
    if not result.strip():
        raise refuse(name, "the PDF has no text layer (scanned?); nothing to index")
    return check_text_size(result, name, limit)
