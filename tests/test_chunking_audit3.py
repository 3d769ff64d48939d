"""Chunking audit 3: setext headings as CommonMark reads them and found in linear time, fences
after a list item's marker holding fences of their own, the parts of a quote's fence closed in
the quote, bounded embedder inputs, overlaps that never open a fence. Each test failed before
its fix (the audit's inputs)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from markdown_it import MarkdownIt

from worker.chunking import MAX_CHUNK_SIZE, chunk_structure
from worker.chunking.base import CONTEXT_CHARS
from worker.chunking.markdown import scan

MD = MarkdownIt()


def _titles(text: str) -> list[str]:
    return scan(text).heading_title


def _fences_balanced(text: str) -> bool:
    """Every fence markdown-it finds in `text` is closed (its token's markup is closed)."""
    lines = text.splitlines()
    for tok in MD.parse(text):
        if tok.type == "fence" and tok.map is not None:
            body = lines[tok.map[0] : tok.map[1]]
            marker = tok.markup
            if len(body) < 2 or marker not in body[-1]:
                return False
    return True


class _Sliced(str):
    """A text that counts the characters its slices copy (what the setext look did)."""

    copied = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def,override]
        part = str.__getitem__(self, key)
        if isinstance(key, slice):
            _Sliced.copied += len(part)
        return part


def test_many_rejected_underlines_under_one_paragraph_copy_a_bounded_share_of_it():
    """A rejected underline never moved the paragraph's start, so each later one copied the
    text back to it: 900 KB took 14.5 s (the copies, quadratic in the text's length)."""
    for text in ("y" * 301 + "\n" + "x\n===\n" * 5_000, "a\nb\nc\nd\n---\n" * 5_000):
        _Sliced.copied = 0
        scan(_Sliced(text))
        assert _Sliced.copied < 2 * len(text), (text[:20], _Sliced.copied)


def test_a_dash_line_that_makes_no_heading_ends_the_paragraph_above():
    long = "Some intro paragraph that is long. " * 10
    assert _titles(long + "\n---\nSecond Part\n---\n\nBody text.\n") == ["Second Part"]


@pytest.mark.parametrize(
    ("text", "titles"),
    [
        ("Intro:\n- one\n- two\n---\n", []),  # a list, then a thematic break
        ("See:\n> quoted\n---\n", []),
        ("Steps:\n1. one\n2. two\n---\n", []),
        ("***\nTitle\n---\n", ["Title"]),  # a thematic break, then a heading
        ("Intro\n\n    code line\n---\n", []),  # indented code, then a thematic break
        ("\ufeffTitle\n=====\n", ["Title"]),  # the byte order mark is no part of it
        ("A title\nover two lines\n---\n\ntext", ["A title over two lines"]),
        ("***\n---\n", []),  # two thematic breaks (it raised IndexError)
        ("para\n***\n---", []),
        ("a\n* * *\n===\n", []),
    ],
)
def test_setext_headings_are_what_commonmark_makes_of_them(text, titles):
    assert _titles(text) == titles
    tokens = MD.parse(text)
    made = [nxt.content for tok, nxt in pairwise(tokens) if tok.type == "heading_open"]
    assert [" ".join(t.lstrip("\ufeff").split()) for t in made] == titles  # (it keeps a BOM)


def test_a_list_item_s_fence_holding_a_fence_is_closed_where_commonmark_closes_it():
    """The look for its close stopped at the inner ```sh line: the item's fence opened
    nothing, the inner close opened a fence that never closed, and every heading after it
    was gone (every chunk embedded as code)."""
    text = "- ````md\n  ```sh\n  make\n  ```\n  ````\n\n# After\n\n" + "Text. " * 200
    layout = scan(text)
    assert layout.heading_title == ["After"]
    assert [(f.start, f.closed) for f in layout.fences] == [(0, True)]
    assert [c.headings for c in chunk_structure(text)][-1] == ("After",)


def test_the_look_for_an_item_s_fence_close_is_bounded(monkeypatch):
    """Passing over the lines that cannot close a fence, each of many items' fence lines
    looked on to the text's end (quadratic); at most LOOK_AHEAD candidates each."""
    from worker.chunking import markdown

    tried = []
    real = markdown._closes
    monkeypatch.setattr(markdown, "_closes", lambda o, m: tried.append(1) or real(o, m))
    for text in ("- ````\n```\n" * 2_000, "- ```x\n" * 2_000, "> ```\n> ```\n" * 2_000):
        tried.clear()
        scan(text)
        assert len(tried) <= (markdown.LOOK_AHEAD + 1) * text.count("\n"), text[:12]


def test_the_parts_of_a_quote_s_fence_are_closed_inside_the_quote():
    """Parts got `> ```python` to open and a bare ``` to close: read as Markdown, the close
    left the quote and opened a fence of its own, never closed."""
    text = (
        "Intro.\n\n> ```python\n"
        + "".join(f"> x_{i} = compute({i})  # step\n" for i in range(80))
        + "> ```\n\nAfter.\n"
    )
    chunks = chunk_structure(text)
    cut = [c for c in chunks if c.fence_open or c.fence_close]
    assert len(cut) >= 2
    for c in cut:
        assert c.fence_close in (None, "> ```")
        assert _fences_balanced(c.embedding_input("t")), c.embedding_input("t")


def test_a_huge_info_string_is_cut_in_every_part_s_embedder_input():
    """A 300 KB opening line went whole into each of 925 parts: 278 M characters to embed."""
    text = "```" + "p" * 300_000 + "\n" + "x = 1\n" * 5_000 + "```\n"
    chunks = chunk_structure(text)
    assert len(chunks) > 10
    assert max(len(c.embedding_input("t")) for c in chunks) <= MAX_CHUNK_SIZE + CONTEXT_CHARS + 8


def test_an_overlap_never_copies_the_start_of_a_quote_s_fence():
    prose = "Run the installer and wait for it. " * 30
    text = (
        prose
        + "\n\n> ```sh\n"
        + "".join(f"> make target{i}\n" for i in range(10))
        + "> ```\n\n"
        + prose
    )
    for c in chunk_structure(text):
        assert _fences_balanced(c.embedding_input("t")), c.content


def test_a_small_part_is_not_merged_forward_into_a_sibling_section():
    """A small `## Notes` was merged into the part after it, which began at `# Uninstall`:
    the merged chunk carried `Install > Notes` over all of Uninstall, which no chunk's path
    then named."""
    text = (
        "# Install\n\n```sh\n"
        + "make install --prefix=/usr/local\n" * 38
        + "```\n\n## Notes\n\nSee above.\n\n# Uninstall\n\nTo remove the tool, delete the "
        "folder and the config file in your home directory. Then restart.\n\n# FAQ\n\n"
        + ("Use the control panel to remove it. " * 20 + "\n\n")
        * 2
    )
    chunks = chunk_structure(text)
    at = text.index("# Uninstall")
    (holder,) = [c for c in chunks if c.start <= at < c.end]
    assert holder.start == at and holder.headings == ("Uninstall",)
    assert all(len(c.content) <= MAX_CHUNK_SIZE for c in chunks)


@pytest.mark.parametrize("opener", ["<!-->", "<!--->", "<?>", "<!-- a comment -->"])
def test_an_html_block_that_ends_on_its_opening_line_hides_no_heading(opener):
    """Its end marker was looked for after the opener only: `<!-->` (which ends at once in
    CommonMark) hid every heading after it."""
    assert _titles(f"{opener}\n# After\n\ntext\n") == ["After"]
