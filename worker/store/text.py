"""Text columns that a host application may have filled with anything.

SQLite stores whatever a driver binds: a Go or C# host that binds a byte array writes a BLOB, a
careless one writes bytes that are not UTF-8, and apsw raises UnicodeDecodeError on reading
such a TEXT value. The rule kidx follows:

* what is indexed (a note's content, a source path or URL) must be UTF-8: a BLOB holding valid
  UTF-8 is taken as the text it is; anything else refuses that item, with the reason stored in
  its state. Guessing would index mojibake, and U+FFFD in place of bytes would silently change
  what the host wrote;
* what is only shown (a title, a kind, a stored hash) is decoded with U+FFFD for what is not
  UTF-8, so that one bad row never stops a listing or a search.
"""

from __future__ import annotations

import re
from typing import Any

from worker.errors import InvalidInput

# A lone surrogate: JSON may escape one ("\ud800"), which json.loads keeps and UTF-8 cannot
# carry into a request, a log line or a stored row.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def without_lone_surrogates(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD: what a server or a model sent, made
    text that can be stored and sent on."""
    return _LONE_SURROGATE.sub("\ufffd", text)


class NotText(ValueError):
    """A value that is not UTF-8 text; the message says where it breaks."""


def shown(value: Any) -> str:
    """Any stored value as text to show: bytes decoded with U+FFFD where not UTF-8."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def strict(value: Any, what: str) -> str:
    """A stored value that must be text: UTF-8 bytes are decoded, other bytes refused."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise NotText(
                f"{what} is not UTF-8 text (byte 0x{value[e.start]:02x} at offset {e.start}); "
                "write it as UTF-8 TEXT"
            ) from None
    return str(value)


def given_text(value: object, name: str) -> str:
    """`value` as the text a column takes, or InvalidInput naming `name`: a Python caller may
    pass any object (bytes, a number, None) or a str SQLite cannot store (a lone surrogate, from
    bytes decoded with `surrogateescape`); they failed as raw TypeErrors, UnicodeEncodeErrors
    and constraint errors, or a number was stored as a title."""
    if not isinstance(value, str):
        raise InvalidInput(f"the {name} must be text (str), not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInput(
            f"the {name} is not UTF-8: it holds a lone surrogate U+{ord(value[e.start]):04X} at "
            f"character {e.start}"
        ) from None
    return value


def integer_or_null(column: str) -> str:
    """SQL: `column` when it holds an integer, else NULL: a host may write any bytes in an id,
    a line or an offset, and TEXT that is not UTF-8 apsw cannot even read (it failed a whole
    search or sweep)."""
    return f"CASE WHEN typeof({column}) = 'integer' THEN {column} END"


def blob_or_null(column: str) -> str:
    """SQL: `column` when it holds a BLOB, else NULL (as `integer_or_null`): a host's `||` on a
    vec0 storage blob makes it TEXT, which apsw could not read (every search failed)."""
    return f"CASE WHEN typeof({column}) = 'blob' THEN {column} END"


def readable(column: str, name: str | None = None) -> str:
    """SQL: `column` as apsw can always read it, named `name` (default: the column's own name,
    without its table's alias). apsw raises UnicodeDecodeError on a TEXT value that is not
    UTF-8, in any column a host wrote (`status`, `last_error`, even `chunk_count`), which
    failed a whole listing: TEXT is read as its bytes, for `shown_row` to make text again;
    any other value as it is."""
    name = name or column.rsplit(".", 1)[-1]
    return (
        f"CASE WHEN typeof({column}) = 'text' THEN CAST({column} AS BLOB) ELSE {column} END "
        f"AS {name}"
    )


def shown_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row read through `readable`, with its bytes (a TEXT's, or a host's BLOB) as text
    (`shown`: U+FFFD where they are not UTF-8)."""
    return {k: shown(v) if isinstance(v, bytes) else v for k, v in row.items()}
