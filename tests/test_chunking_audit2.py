"""Chunking audit 2: heading metadata bounded, CommonMark's fence indentation, every line end,
literal HTML blocks, front matter and a byte order mark, over-long LLM units, CJK and
grapheme-safe cuts. Each test failed before its fix (repros in the audit's notes)."""

from __future__ import annotations

import itertools

from worker.chunking import MAX_CHUNK_SIZE, chunk_structure
from worker.chunking.markdown import PATH_MAX, TITLE_MAX, scan

PROSE = "Some explanatory prose that fills the section with words. " * 6


def _titles(text: str) -> list[str]:
    return scan(text).heading_title


def _covered(text: str, chunks) -> bool:
    seen: set[int] = set()
    for c in chunks:
        assert c.content == text[c.start : c.end]
        seen.update(range(c.start, c.end))
    return all(i in seen for i, ch in enumerate(text) if not ch.isspace())


# -- 1. heading metadata cannot grow with the text ------------------------------------------


def test_a_heading_line_of_200_kb_gives_a_bounded_title_and_path():
    # One line starting with "# " (a pasted blob): its title was the whole line, and every one
    # of the ~300 chunks stored it (61.6 M characters of headings for a 200 KB text).
    text = "# " + "word " * 40_000
    (title,) = _titles(text)
    assert len(title) <= TITLE_MAX and title.startswith("word word") and title.endswith("…")
    assert not title[:-1].endswith(" ")  # cut at a word boundary
    chunks = chunk_structure(text)
    assert _covered(text, chunks)  # only the metadata is cut, never the text
    assert all(len(" > ".join(c.headings)) <= PATH_MAX for c in chunks)


def test_a_long_paragraph_over_an_underline_is_not_a_heading():
    body = ("Body text here. " * 40 + "\n\n") * 5
    long_para = "lorem ipsum " * 8500
    assert _titles(long_para + "\n===\n\n" + body) == []
    assert _titles("A real title\n===\n\n" + body) == ["A real title"]
    # A title hard-wrapped over up to three short lines is still one (CommonMark allows more).
    assert _titles("A title that\nwraps once\n---\n\n" + body) == ["A title that wraps once"]
    four = "line one\nline two\nline three\nline four\n---\n\n"
    assert _titles(four + body) == []


def test_a_deep_path_of_long_titles_is_bounded_and_keeps_the_deepest_title():
    titles = [f"T{k} " + "x" * 190 for k in range(1, 7)]
    text = "".join("#" * k + " " + t + "\n\n" + PROSE + "\n\n" for k, t in enumerate(titles, 1))
    chunks = chunk_structure(text)
    last = chunks[-1].headings
    assert len(last) == 6  # the depth is kept
    assert len(" > ".join(last)) <= PATH_MAX
    assert last[-1] == titles[-1]  # the most specific title whole; the shallowest cut


def test_lone_cr_text_stores_bounded_headings():
    # Lone CRs made a 200 KB note one line: one heading whose title was the whole note.
    text = "# Title\r\r" + ("Some sentence of text here. " * 20 + "\r\r") * 360
    chunks = chunk_structure(text)
    assert _covered(text, chunks)
    assert {c.headings for c in chunks} == {("Title",)}


# -- 2. a fence is indented at most 3 spaces -------------------------------------------------


def test_a_backtick_line_indented_4_spaces_or_a_tab_opens_no_fence():
    for indent in ("    ", "\t", "  \t", "        "):
        doc = (
            "# Writing code blocks\n\n" + PROSE + "\n\nTo start a fenced block, type:\n\n"
            f"{indent}```\n\n" + "".join(f"## Section {i}\n\n{PROSE}\n\n" for i in range(1, 6))
        )
        lay = scan(doc)
        assert lay.fences == [], indent
        assert lay.heading_title == ["Writing code blocks"] + [f"Section {i}" for i in range(1, 6)]


def test_a_backtick_line_indented_4_spaces_does_not_close_a_fence():
    doc = (
        "```python\ndef f():\n    '''\n    ```\n    '''\n# a comment, still code\nx = 1\n```\n\n"
        "# Real heading\n\n" + PROSE
    )
    assert _titles(doc) == ["Real heading"]
    (fence,) = scan(doc).fences
    assert fence.closed and doc[fence.start : fence.end].endswith("x = 1\n```")
    # Up to 3 spaces, a fence still opens and closes.
    doc = "Intro.\n\n   ```sh\n# not a heading\n  ```\n\n# Heading\n\nBody."
    assert _titles(doc) == ["Heading"]
    assert [f.closed for f in scan(doc).fences] == [True]


# -- 3. every line end: "\r\n", "\r" and "\n" ------------------------------------------------


def test_lone_cr_and_crlf_line_ends_give_the_same_structure_as_lf():
    body = "Paragraph text that explains the section in a few words. " * 4
    lf = "".join(f"# Section {i}\n\n{body}\n\n" for i in range(1, 9))
    want = scan(lf)
    assert want.heading_title == [f"Section {i}" for i in range(1, 9)]
    for eol in ("\r", "\r\n"):
        text = lf.replace("\n", eol)
        lay = scan(text)
        assert lay.heading_title == want.heading_title, repr(eol)
        assert lay.heading_level == want.heading_level
        assert len(lay.breaks) == len(want.breaks) == 15
        # The same positions, shifted by the longer line ends: paragraphs start at the text
        # after them, never between a "\r" and its "\n".
        assert [text[p : p + 9] for p in lay.heading_pos] == ["# Section"] * 8
        assert all(text[p - 1] in "\r\n" and text[p] not in "\r\n" for p in lay.breaks)


def test_lone_cr_setext_fences_and_empty_headings():
    text = "Title\r===\r\rProse.\r\r```\r# code\r```\r\r#\r\n\r\nbody\r\n# B\r\n"
    lay = scan(text)
    assert lay.heading_title == ["Title", "", "B"]
    assert [f.closed for f in lay.fences] == [True]


def test_lone_cr_chunks_carry_their_own_sections():
    body = "Paragraph text that explains the section in some more words. " * 8
    text = "".join(f"# Section {i}\r\r{body}\r\r" for i in range(1, 9))
    chunks = chunk_structure(text)
    assert _covered(text, chunks)
    assert {c.headings for c in chunks} == {(f"Section {i}",) for i in range(1, 9)}
    text = "\r".join(["# H", "", PROSE * 5, "", "<!--", "# x", PROSE * 3, "-->", "", "## I", PROSE])
    chunks = chunk_structure(text)
    assert _covered(text, chunks) and all(len(c.content) <= MAX_CHUNK_SIZE for c in chunks)
    assert all(a.start < b.start for a, b in itertools.pairwise(chunks))
    assert {c.headings for c in chunks} == {("H",), ("H", "I")}


# -- 6. literal HTML blocks, front matter, a byte order mark --------------------------------


def test_no_heading_inside_literal_html_blocks():
    doc = (
        "Intro paragraph.\n\n<!--\n# Old draft heading, commented out\n-->\n\n"
        "<pre>\n# install the tool\npip install kidx\n</pre>\n\n"
        "<script>\n# not markdown\n</script>\n\n<STYLE type='x'>\n# nor this\n</style>\n\n"
        "<!-- one line --> then text\n# After a one-line comment\n\n# Real heading\n\nBody.\n"
    )
    assert _titles(doc) == ["After a one-line comment", "Real heading"]
    assert _titles("<!--\n# a\n```\n-->\n# b\n") == ["b"]  # nor a fence
    assert _titles("Text.\n\n<!-- never closed\n# a\n\n# b\n") == []  # to the end (CommonMark)
    assert _titles("<div>\n\n# c\n") == ["c"]  # other HTML: Markdown again after a blank line


def test_yaml_front_matter_is_no_heading_and_stays_in_the_text():
    body = ("Body text of the document, a sentence or two long. " * 8 + "\n\n") * 6
    fm = "---\ntitle: My Post\ndate: 2024-01-01\n# a YAML comment\ntags: [a, b]\n---\n\n"
    for text in (fm + body, fm.replace("\n", "\r\n") + body, "\ufeff" + fm + body):
        assert _titles(text) == []
        chunks = chunk_structure(text)
        assert {c.headings for c in chunks} == {()}
        assert _covered(text, chunks) and "title: My Post" in chunks[0].content
    assert _titles(fm.replace("---\n\n", "...\n\n") + "# H\n") == ["H"]
    # A thematic break opening a document is no front matter: what follows is Markdown.
    assert _titles("---\n\nNot yaml.\n\n# Heading\n\n---\n") == ["Heading"]
    assert _titles("---\ntitle: never closed\n\n# Heading\n") == ["Heading"]


def test_a_leading_byte_order_mark_does_not_hide_the_first_heading():
    text = "\ufeff# Title\n\n" + PROSE
    lay = scan(text)
    assert lay.heading_title == ["Title"] and lay.heading_pos == [0]
    assert _titles("\ufeff```\n# code\n```\n# After\n") == ["After"]
    chunks = chunk_structure(text + "\n\n## Sub\n\n" + PROSE)
    assert chunks[0].headings == ("Title",) and chunks[0].start == 0
