"""Source files in a declared encoding: `# -*- coding: latin-1 -*-` is legal Python 3 (PEP 263),
and such a file was refused as "not UTF-8" and never indexed. What a coding comment declares is
read when the bytes are not UTF-8; a file that declares nothing, or no character set, or
whose bytes its declaration cannot read, is refused as before, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FakeEmbedder
from worker.bulk import index_item
from worker.errors import InvalidInput
from worker.indexers import IndexOptions
from worker.indexers.code import search_code
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.sources.code import read_code
from worker.store.items import add_item, get_state

SOURCE = "# -*- coding: {coding} -*-\ndef café():\n    return 'crème brûlée'\n"


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("coding", "charset"),
    [("latin-1", "latin-1"), ("cp1252", "cp1252"), ("iso-8859-15", "iso8859-15")],
)
def test_a_file_in_the_encoding_it_declares_is_read(tmp_path, coding, charset):
    text = SOURCE.format(coding=coding)
    path = write(tmp_path, "m.py", text.encode(charset))
    assert read_code(path, FilesSettings(roots=[tmp_path])) == text


def test_a_declaration_on_the_second_line_after_a_shebang_counts(tmp_path):
    text = "#!/usr/bin/env python\n# vim: set fileencoding=latin-1 :\nx = 'é'\n"
    path = write(tmp_path, "m.py", text.encode("latin-1"))
    assert read_code(path, FilesSettings(roots=[tmp_path])) == text


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ("x = 'é'\n".encode("latin-1"), "is not UTF-8 text (byte 5)"),  # declares nothing
        (b"x = 1\n# coding: latin-1\ny = '\xe9'\n", "is not UTF-8 text"),  # too late
        (b"# coding: unicode_escape\nx = '\xe9\\n'\n", "is not UTF-8 text"),  # no charset
        (b"# coding: base64\nx = '\xe9'\n", "is not UTF-8 text"),
        (b"# coding: no-such-codec\nx = '\xe9'\n", "is not UTF-8 text"),
        (b"# coding: ascii\nx = '\xe9'\n", "is not UTF-8, nor the ascii it declares (byte 21)"),
        (b"# coding: utf-8\nx = '\xe9'\n", "is not UTF-8 text (byte 21)"),
        # EBCDIC: its own declaration reads as garbage in it; the Latin-1 file was indexed so
        (b"# -*- coding: cp037 -*-\nx = '\xe9'\n", "is not UTF-8 text"),
    ],
)
def test_what_cannot_be_read_as_declared_is_refused_saying_so(tmp_path, data, says):
    path = write(tmp_path, "m.py", data)
    with pytest.raises(
        InvalidInput, match=r"m\.py: " + says.replace("(", r"\(").replace(")", r"\)")
    ):
        read_code(path, FilesSettings(roots=[tmp_path]))


def test_a_latin1_module_is_indexed_and_found_by_its_words(db, tmp_path):
    fake = FakeEmbedder()
    path = write(tmp_path, "m.py", SOURCE.format(coding="latin-1").encode("latin-1"))
    item = add_item(db, kind="code", title="m.py", content="", source=str(path))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    result = index_item(db, item, embedder=fake, options=options)
    assert result.status == "indexed", get_state(db, item)
    hits, via, _ = search_code(db, "brûlée", fake, k=3)
    assert "fts" in via.split("+") and hits[0].item_id == item
    assert "crème brûlée" in db.scalar("SELECT content FROM code_chunks WHERE item_id = ?", (item,))
