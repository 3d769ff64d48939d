"""Chunking audit 2: heading metadata bounded, CommonMark's fence indentation, every line end,
literal HTML blocks, front matter and a byte order mark, over-long LLM units, CJK and
grapheme-safe cuts. Each test failed before its fix (repros in the audit's notes)."""

from __future__ import annotations

import itertools
import json
import random
import re
import unicodedata

import pytest

from worker.chunking import MAX_CHUNK_SIZE, chunk_structure
from worker.chunking.llm import UNIT_MAX, LLMChunker, chunk_llm, units_of
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


@pytest.mark.parametrize("item", ["- Step one, run:", "2. Run:", "* Run:\n\n  it says"])
def test_a_fence_left_open_in_a_list_item_ends_with_the_item(item):
    """An item's fence indented under it (1 to 3 columns) and never closed: CommonMark ends it
    with the item; it ran to the text's end, every later heading code."""
    doc = f"# Guide\n\n{item}\n   ```sh\n   make install\n- Next.\n\n# Section\n\n{PROSE}"
    assert _titles(doc) == ["Guide", "Section"]
    assert scan(doc).fences == []


def test_a_fence_indented_less_than_an_item_s_content_is_not_the_item_s():
    """`- Run:` puts its content at column 2: a fence at 1 is top-level, its `# comment` code.
    Taken for the item's (its end at the comment), the comment was a heading and the fence's
    closing line opened one that ran to the text's end."""
    doc = (
        "# Install\n\n- Run the script:\n\n ```sh\n# fetch the sources\ngit clone x\n ```\n\n"
        f"# Usage\n\n{PROSE}\n\n# Troubleshooting\n\n{PROSE}\n"
    )
    assert _titles(doc) == ["Install", "Usage", "Troubleshooting"]
    assert [f.closed for f in scan(doc).fences] == [True]


@pytest.mark.parametrize(
    "opener, inside, closer",
    [
        ("- ```sh", "  ", "  ```"),
        ("* ~~~", "  ", "  ~~~"),
        ("1. ```sh", "   ", "   ```"),
        ("> ```sh", "> ", "> ```"),
        ("- > ```sh", "  > ", "  > ```"),
    ],
)
def test_a_fence_opened_after_a_list_item_s_or_a_quote_s_marker_closes(opener, inside, closer):
    """Unseen, the item's indented closing line was read as a fence that never closed: every
    heading after it was taken for code, and prose was sent to the embedder re-fenced."""
    doc = (
        f"# Setup\n\n{opener}\n{inside}# a comment, code\n{inside}make install\n{closer}\n\n"
        + "".join(f"## Part {i}\n\n{PROSE}\n\n" for i in range(1, 7))
    )
    lay = scan(doc)
    assert lay.heading_title == ["Setup"] + [f"Part {i}" for i in range(1, 7)]
    (fence,) = lay.fences
    assert fence.closed and doc[fence.start : fence.end].endswith(closer)
    chunks = chunk_structure(doc, target=650)
    assert _covered(doc, chunks)
    assert [c.headings[-1] for c in chunks[1:]] == [f"Part {i}" for i in range(2, 7)]
    assert all(c.fence_open is None and c.fence_close is None for c in chunks)


def test_a_nested_list_item_s_fence_indented_4_or_more_is_never_cut_inside():
    """A fence under a nested item is indented past 3 spaces: taken for an indented code
    block, its blank lines were paragraph breaks, and a block well under the maximum was cut."""
    body = "\n\n".join(
        f"      result_{i} = run_step({i}, retries=3, timeout=30)" for i in range(14)
    )
    doc = (
        "Steps:\n\n1. Install:\n   - On Linux run:\n\n      ```python\n"
        + body
        + "\n      ```\n\n   - Done.\n\n"
        + PROSE
    )
    start, end = doc.index("```"), doc.rindex("```") + 3
    (fence,) = scan(doc).fences
    assert fence.closed and doc[fence.start : fence.end].strip() == doc[start:end]
    for target in (200, 650):
        chunks = chunk_structure(doc, target=target)
        assert _covered(doc, chunks)
        assert not [c for c in chunks if start < c.start < end or start < c.end < end], target


def test_indented_fence_lines_that_never_close_open_nothing_and_cost_little():
    """A fence line indented 4 or more opens only when its closing line follows: the look
    ahead stops at the next line of its character, so many such lines are no quadratic scan
    (and the lone ones open nothing: the headings after them stay)."""
    lone = "    ```x\n" * 3000 + "\n# Heading\n\n" + PROSE
    lay = scan(lone)
    assert lay.fences == [] and lay.heading_title == ["Heading"]
    pair = "Intro.\n\n    ```\n    code\n    ```\n\n# Heading\n\n" + PROSE
    lay = scan(pair)
    assert [f.closed for f in lay.fences] == [True] and lay.heading_title == ["Heading"]


@pytest.mark.parametrize(
    "doc, fences",
    [
        # an item's line that only mentions ``` opens nothing: the item ends at the heading
        ("- ``` opens a block\n- ~~~ too\n\n# After\n\ntext", []),
        # the closing line sits under the item's text, 4 columns in: it closes
        ("1. ```sh\n    make\n    ```\n\n# After\n\ntext", [True]),
        # a list marker or a quote before ``` inside a block is its text, not its end
        ("```\n1. ```\n```\n# After\n", [True]),
        ("~~~\n> ~~~\n~~~\n# After\n", [True]),
    ],
)
def test_fences_in_and_around_items_close_where_commonmark_closes_them(doc, fences):
    """Found by comparing the scanner with markdown-it-py over random documents: each read as
    a fence that never closed, which hid the heading after it."""
    lay = scan(doc)
    assert [f.closed for f in lay.fences] == fences
    assert lay.heading_title == ["After"]


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


# -- 4. LLM units are bounded whatever the text -----------------------------------------------


class _Counting:
    """A chunk model that makes each unit a chunk, and keeps the size of each request."""

    model_id = "counting"

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def complete_json(self, messages, *, schema, name, until=None):
        body = messages[-1]["content"]
        self.sizes.append(len(body))
        n = int(re.search(r"cut into (\d+) numbered", body)[1])
        return {"chunks": [{"start": i, "end": i, "summary": "s"} for i in range(1, n + 1)]}


def test_llm_units_and_prompts_are_bounded_without_sentence_ends():
    texts = {
        "minified JSON": json.dumps({f"k{i}": f"value number {i}" for i in range(3000)}),
        "CJK without stops": "日本語の文章です" * 5000,
        "a log paragraph": "\n".join(
            f"2026-12-03 INFO id={i} path=/api status=200" for i in range(2000)
        ),
        "one enormous word": "x" * 30_000,
    }
    for name, text in texts.items():
        units = units_of(text, 0, len(text))
        assert units[0].start == 0 and units[-1].end == len(text), name
        assert all(a.end == b.start for a, b in itertools.pairwise(units)), name
        assert max(len(text[u.start : u.end].strip()) for u in units) <= UNIT_MAX, name
        model = _Counting()
        chunks = chunk_llm(text, LLMChunker(model, window=6000))
        assert max(model.sizes) < 6000 + 2 * UNIT_MAX, name  # was the whole text
        assert _covered(text, chunks) and all(len(c.content) <= MAX_CHUNK_SIZE for c in chunks)
    # Lines first: each log line is whole in its unit.
    log = texts["a log paragraph"]
    assert all(log[u.start : u.end].strip().startswith("2026") for u in units_of(log, 0, len(log)))


def test_llm_units_do_not_start_a_sentence_that_opens_like_a_fence():
    # Hypothesis found it (test_llm_chunking_audit, seed 2): a unit cut after "the. " started
    # with "```py" in the middle of a line, so its chunk read as an unclosed code block.
    text = "the " * 200 + "the. ```py\n" + "\n".join(["    return x  # done."] * 40)
    for u in units_of(text, 0, len(text)):
        assert not text[u.start : u.end].lstrip().startswith("```")
    # Nor end one inside a line that opens like a fence: "``` the. ... ]]` the" has a backtick
    # in its info string, so it is no fence, but its first sentence alone is one (seed 2 too).
    line = "``` the. " + "the the the. " * 60 + "the.]]` the the."
    text = "the " * 30 + "the. ```py\nx = 1\n" + line + "\n\nEnd."
    for u in units_of(text, 0, len(text)):
        assert all(f.closed for f in scan(text[u.start : u.end]).fences), text[u.start : u.end]


# -- 5. CJK sentence ends, grapheme-safe cuts ---------------------------------------------------


def test_cjk_prose_is_cut_at_sentence_ends_and_overlaps():
    r = random.Random(3)
    ja = "".join("日本語の文章" * r.randint(1, 4) + r.choice("。！？") for _ in range(400))
    chunks = chunk_structure(ja)
    assert _covered(ja, chunks) and len(chunks) > 5
    parts = [ja[c.start : chunks[k + 1].start] for k, c in enumerate(chunks[:-1])]
    assert all(p[-1] in "。！？" for p in parts)  # no cut mid-sentence
    assert all(c.end > n.start for c, n in itertools.pairwise(chunks))  # an overlap
    assert all(ja[n.start : c.end][-1] in "。！？" for c, n in itertools.pairwise(chunks))
    assert len(units_of(ja, 0, len(ja))) > 50  # was one unit
    zh = "这是一个句子．" * 500  # fullwidth full stop
    assert all(c.content[-1] == "．" for c in chunk_structure(zh)[:-1])


def test_hard_cuts_never_split_a_grapheme():
    texts = [
        "ผู้ใหญ่ใจดี" * 400,  # Thai: combining vowel and tone marks
        "👩\u200d👩\u200d👧\u200d👦" * 700,  # a ZWJ family
        "e\u0301" * 3000,  # a combining accent
        "❤\ufe0f" * 3000,  # a variation selector
        "🇯🇵" * 1500,  # flags: pairs of regional indicators
        "👍🏽" * 1500,  # a skin tone
    ]
    for text in texts:
        for chunks in (chunk_structure(text), chunk_llm(text, LLMChunker(_Counting()))):
            assert _covered(text, chunks)
            assert all(len(c.content) <= MAX_CHUNK_SIZE for c in chunks)
            for c in chunks:
                first = c.content[0]
                assert unicodedata.category(first) not in ("Mn", "Mc", "Me"), repr(c.content[:3])
                assert first not in "\u200d\ufe0f" and not "\U0001f3fb" <= first <= "\U0001f3ff"
                assert c.content[-1] != "\u200d"
                if first == "🇯" or first == "🇵":
                    assert first == "🇯" and len(c.content) % 2 == 0


def test_a_long_paragraph_of_lone_cr_lines_is_cut_at_line_ends():
    # A poem or a listing without sentence ends: cut at its lines, as the same text with "\n".
    lines = [f"line number {i} of a poem without any stop" for i in range(120)]
    for eol in ("\n", "\r", "\r\n"):
        text = eol.join(lines)
        chunks = chunk_structure(text)
        assert len(chunks) > 3 and _covered(text, chunks)
        assert all(c.start == 0 or text[c.start - 1] in "\r\n" for c in chunks), repr(eol)
        units = units_of(text, 0, len(text))
        assert all(text[u.start : u.end].strip().startswith("line") for u in units)
