"""Which files of a code tree to index, and reading one.

Why it looks the way it does:

* A tree is listed the way git would see it: `.gitignore` files (the root's, nested ones, and
  those of the enclosing work tree above the root) and `.git/info/exclude`, each relative to its
  own folder, deeper files overriding shallower ones, an ignored folder never entered. Indexing
  build output or a virtualenv would drown the real code in duplicates.
* Vendored and generated folders are skipped by name even without a `.gitignore`, and so are
  binaries, empty files, files over `max_bytes`, lock files and anything whose suffix is not a
  known source suffix: what is left is text a person wrote.
* Symlinks are never followed during a walk: a target inside the root is listed at its real path
  anyway, one outside it is not part of the tree, and a link loop cannot hang the walk.
"""

from __future__ import annotations

import codecs
import os
import re
import stat
import time
import warnings
from pathlib import Path

import pathspec
import re2
from pathspec.patterns.gitignore.spec import GitIgnoreSpecPattern

from worker.errors import InvalidInput
from worker.regular import read_regular
from worker.settings import FilesSettings
from worker.sources.decoding import NOT_CHARSETS, bom
from worker.sources.files import read_under_roots

# The lists are written as words: the formatter would put each string on a line of its own.
CODE_SUFFIXES = frozenset(
    """
    .py .pyi .pyx .js .jsx .mjs .cjs .ts .tsx .mts .cts .vue .svelte .go .rs .java .kt .kts
    .scala .groovy .gradle .c .h .cc .cpp .cxx .hpp .hh .hxx .m .mm .cs .fs .vb .rb .php .pl
    .pm .swift .dart .sh .bash .zsh .fish .ps1 .sql .lua .r .jl .ex .exs .erl .hrl .hs .ml
    .mli .clj .cljs .elm .nim .zig .v .proto .graphql .css .scss .less .toml .yaml .yml .json
    .ini .cfg
    """.split()  # noqa: SIM905
)
"""Suffixes (compared lower-case) of files that hold code or its configuration. Markdown and
plain text are notes and files, not code; HTML is mostly generated or a template."""

CODE_NAMES = frozenset({"Makefile", "GNUmakefile", "Dockerfile", "Justfile", "Rakefile"})
"""Source files known by their whole name, having no suffix."""

LOCK_FILES = frozenset(
    """
    package-lock.json npm-shrinkwrap.json pnpm-lock.yaml yarn.lock bun.lockb composer.lock
    Cargo.lock poetry.lock Pipfile.lock uv.lock pdm.lock Gemfile.lock mix.lock flake.lock
    go.sum packages.lock.json
    """.split()  # noqa: SIM905
)
"""Generated dependency pins: large, machine-written, never what a question is about."""

SKIP_DIRS = frozenset(
    """
    .git .hg .svn node_modules vendor third_party .venv venv env __pycache__ dist build
    target .tox .nox .eggs .mypy_cache .pytest_cache .ruff_cache .hypothesis site-packages
    .idea .vscode .gradle .next
    """.split()  # noqa: SIM905
)
"""Vendored, generated and tool folders, skipped by name (and `*.egg-info`)."""

_SNIFF = 8192


def _wide(data: bytes) -> tuple[str, int] | None:
    """The codec and length of a UTF-16 or UTF-32 byte-order mark `data` begins with: text
    whose NUL bytes are half its characters (Windows tools save .ps1, .sql and .cs files so)."""
    mark = bom(data)
    return mark if mark and mark[0] != "utf-8" else None


def _binary(head: bytes) -> bool:
    """A NUL byte in the first 8 KB, what git and grep call binary; after a UTF-16 or UTF-32
    byte-order mark, a NUL character (what a mark at the start of a binary file gives)."""
    wide = _wide(head)
    if wide is None:
        return b"\0" in head
    return "\0" in head[wide[1] :].decode(wide[0], "replace")  # cut anywhere: "replace"


def _wanted_name(name: str) -> bool:
    if name in LOCK_FILES or name.endswith((".min.js", ".min.css")):
        return False
    return name in CODE_NAMES or os.path.splitext(name)[1].lower() in CODE_SUFFIXES


def _skipped_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.endswith(".egg-info")


_Specs = list[tuple[tuple[str, ...], pathspec.GitIgnoreSpec]]
"""(folder relative to the top, its patterns), lowest precedence first."""


# A `.gitignore` kidx reads: git's own are a few KB. Larger, or with a longer line, it is no
# such file (a 1 MB line took 9 s to compile, a sparse file of NULs minutes): its folder is
# left out, said, rather than listed against patterns it did not read.
GITIGNORE_MAX = 1 << 20
GITIGNORE_LINE_MAX = 4096


class _Unusable(Exception):
    """A `.gitignore` that is there but cannot be used; its message says why."""


def _load_spec(file: Path, budget: _Budget) -> list[pathspec.GitIgnoreSpec] | None:
    """The patterns of `file` (`_sets`), None when there is none; `_Unusable` when one is there that
    cannot be used. Not followed if a link (git refuses one too: out of the roots, it was
    read, /proc/<pid>/environ included), and opened without blocking (a FIFO hung)."""
    try:
        data = read_regular(file, GITIGNORE_MAX + 1)
    except (FileNotFoundError, NotADirectoryError):  # (a worktree's `.git` is a file)
        return None
    except OSError as e:
        raise _Unusable(f"cannot be read ({e.strerror or e})") from None
    if data is None:
        raise _Unusable("is not a regular file")
    if len(data) > GITIGNORE_MAX:
        raise _Unusable(f"is larger than {GITIGNORE_MAX} bytes")
    lines = data.decode("utf-8", errors="replace").splitlines()
    if any(len(line) > GITIGNORE_LINE_MAX for line in lines):
        raise _Unusable(f"has a line longer than {GITIGNORE_LINE_MAX} characters")
    with warnings.catch_warnings():  # (re's FutureWarning on `[[`: the pattern is as written)
        warnings.simplefilter("ignore", FutureWarning)
        patterns = [p for line in lines if line and (p := _pattern(line)) is not None]
    return _sets(patterns, budget)


# POSIX character classes, which git's patterns take inside brackets (`[[:digit:]]`) and
# pathspec does not: its translation (`[[:digit:]\\]`) matched other characters, and RE2
# refused it. Given to pathspec as the ranges they are (in the C locale, as git reads them).
_POSIX_CLASSES = {
    "alnum": "a-zA-Z0-9",
    "alpha": "a-zA-Z",
    "blank": " \t",
    "cntrl": "\x00-\x1f\x7f",
    "digit": "0-9",
    "graph": '"-~!',
    "lower": "a-z",
    "print": " -~",
    "punct": '"-.:-@[-`{-~!',  # (no "/": it split the pattern; no "!" first: negation)
    "space": " \t\n\r\f\v",
    "upper": "A-Z",
    "xdigit": "0-9A-Fa-f",
}
_POSIX_CLASS = re.compile(r"\[:([a-z]+):\]")


def _pattern(line: str) -> GitIgnoreSpecPattern | None:
    """A line's pattern; None for one git would never match (`foo\\`, `[z-a]`: pathspec
    raised on them, and the whole import failed)."""
    if "[:" in line:
        if any(name not in _POSIX_CLASSES for name in _POSIX_CLASS.findall(line)):
            return None  # an unknown class: git's pattern matches nothing
        line = _POSIX_CLASS.sub(lambda m: _POSIX_CLASSES[m[1]], line)
    try:
        return GitIgnoreSpecPattern(line)
    except (ValueError, re.error):
        return None


# Patterns matched by one RE2 set. Python's `re` backtracks: one 20-character line
# (`*a*a*a*a*a*a*a*a*b`) took 51 s to test a 60-character name, and a hostile tree hung the
# import. RE2 matches in linear time, but compiles a set of a few thousand patterns past its
# memory budget (measured: 1,000 short ones compiled, 2,000 did not): larger files are cut.
SET_PATTERNS = 256


def _sets(patterns: list[GitIgnoreSpecPattern], budget: _Budget) -> list[pathspec.GitIgnoreSpec]:
    """`patterns` in RE2 sets, in order (the last that matches decides, across sets too); a
    set RE2 cannot compile is halved, and a single pattern it cannot is `_Unusable`."""
    out: list[pathspec.GitIgnoreSpec] = []
    for start in range(0, len(patterns), SET_PATTERNS):
        out += _compiled(patterns[start : start + SET_PATTERNS], budget)
    return out


# What one listing may spend compiling `.gitignore` patterns: a hostile file within the size
# limits (`*a*a*a...` lines) took 10-16 s, and a tree of such folders as many times that.
GITIGNORE_SECONDS = 10.0


class _Budget:
    """The time left for a listing's `.gitignore` patterns (`GITIGNORE_SECONDS`)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.until = seconds, time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() >= self.until:
            raise _Unusable(
                f"was not compiled: the listing's {self.seconds:g} s for .gitignore patterns "
                "is spent"
            )


def _compiled(
    patterns: list[GitIgnoreSpecPattern], budget: _Budget
) -> list[pathspec.GitIgnoreSpec]:
    budget.check()
    try:
        return [pathspec.GitIgnoreSpec(patterns, backend="re2")]
    except re2.error:
        if len(patterns) == 1:
            raise _Unusable(
                f"has a pattern kidx cannot match: {patterns[0].pattern[:80]!r}"
            ) from None
        half = len(patterns) // 2
        return _compiled(patterns[:half], budget) + _compiled(patterns[half:], budget)


def _ignored(specs: _Specs, parts: tuple[str, ...], is_dir: bool) -> bool:
    """Git's rule: the last matching pattern, from the deepest `.gitignore`, decides."""
    result = False
    for base, spec in specs:
        if parts[: len(base)] != base or len(parts) == len(base):
            continue
        rel = "/".join(parts[len(base) :]) + ("/" if is_dir else "")
        if not rel.isascii():  # RE2 takes UTF-8: a name's bytes that are not, as U+FFFD
            rel = rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        include = spec.check_file(rel).include
        if include is not None:
            result = include
    return result


def _outer_specs(root: Path, budget: _Budget) -> tuple[_Specs, tuple[str, ...]]:
    """The patterns that apply from above `root`: `.git/info/exclude` and the `.gitignore` files
    of the enclosing work tree down to the root's parent; and the root's path below that top.
    Dropped when they ignore the root itself: a folder asked for by name is listed."""
    top = next((p for p in (root, *root.parents) if (p / ".git").exists()), None)
    if top is None:
        return [], ()
    prefix = root.relative_to(top).parts
    specs: _Specs = []
    exclude = top / ".git" / "info" / "exclude"
    for base, file in [((), exclude)] + [
        (prefix[:i], top.joinpath(*prefix[:i], ".gitignore")) for i in range(len(prefix))
    ]:
        try:
            spec = _load_spec(file, budget)
        except _Unusable as e:
            raise InvalidInput(f"{file} {e}: the listing below it needs its patterns") from None
        if spec is not None:
            specs += [(base, one) for one in spec]
    if prefix and any(_ignored(specs, prefix[:i], True) for i in range(1, len(prefix) + 1)):
        return [], prefix
    return specs, prefix


def _check_file(path: Path, max_bytes: int, *, follow: bool = False) -> str | None:
    """Why a file cannot be indexed, or None. Its start is read without blocking and (unless
    `follow`: a file named directly) without following a link: a FIFO swapped in after the
    listing's look hung the listing for good."""
    size = path.stat().st_size
    if size == 0:
        return EMPTY
    if size > max_bytes:
        return f"is larger than {max_bytes} bytes ({size})"
    head = read_regular(path, _SNIFF, follow=follow)
    if head is None:
        return "is not a regular file"
    if _binary(head):
        return "is binary"
    try:  # its start, as the run will read it: `kidx add code FOLDER` added what `kidx add
        # code FILE` refused (random bytes, Latin-1), and each failed at its run
        text = _decoded(head, final=len(head) == size)
    except _NotText as e:
        return str(e)
    if len(head) == size and not text.strip():
        return EMPTY  # (a package's `__init__.py` of a blank line: "no code to index" at its run)
    return None


EMPTY = "is empty"  # (or white space only: left out of a folder's listing without a word)


def list_code_files(
    path: str | Path,
    *,
    max_bytes: int = 1_000_000,
    skipped: list[tuple[Path, str]] | None = None,
) -> list[Path]:
    """The source files to index under `path` (sorted), or `path` itself if it is a file.

    A file named directly is refused (`InvalidInput`) only if it is missing, binary, empty or
    too large: naming it is asking for it, whatever its suffix or ignore rules say.

    With `skipped`, each source file (or folder) of the tree that is left out for a reason
    its user would want told is appended to it as (path, reason): larger than `max_bytes`,
    binary, unreadable, or a name that is not UTF-8. Files that are empty, ignored, or not
    source by name are left out silently.
    """
    given = Path(path)
    if not given.exists():
        raise InvalidInput(f"{given}: no such file or directory")
    if not given.is_dir():
        if not given.is_file():
            raise InvalidInput(f"{given} is not a regular file")
        try:  # (named directly: a link to it is followed, as the roots' guard allows)
            reason = _check_file(given, max_bytes, follow=True)
        except OSError as e:
            raise InvalidInput(f"{given} cannot be read: {e}") from e
        if reason:
            raise InvalidInput(f"{given} {reason}")
        return [given]

    def skip(parts: tuple[str, ...], reason: str) -> None:
        if skipped is not None:
            skipped.append((given.joinpath(*parts), reason))

    def not_utf8(name: str) -> bool:
        """A name whose bytes are not UTF-8 (held as lone surrogates): it cannot be an item's
        source or title, which are UTF-8 text."""
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    budget = _Budget(GITIGNORE_SECONDS)
    outer, prefix = _outer_specs(given.resolve(), budget)
    found: list[Path] = []
    real = given.resolve()  # (the folder named may be a link: the walk below follows none)
    top = os.stat(real)
    stack: list[tuple[Path, tuple[str, ...], _Specs, tuple[int, int]]] = [
        (real, (), outer, (top.st_dev, top.st_ino))
    ]
    while stack:
        folder, rel, specs, identity = stack.pop()
        try:
            entries = _entries(folder, identity)
            spec = _load_spec(folder / ".gitignore", budget)
        except _Unusable as e:  # its patterns unread: none of its files is listed
            skip((*rel, ".gitignore"), f"{e}: its folder is left out")
            continue
        except OSError as e:
            if rel:  # the top folder's own failure is the caller's to see
                skip(rel, f"cannot be read ({e.strerror or e})")
            continue
        if entries is None:
            skip(rel, "was replaced during the listing: left out")
            continue
        if spec is not None:
            specs = [*specs, *((prefix + rel, one) for one in spec)]
        for name, st in entries:
            parts = (*rel, name)
            if st is None:  # vanished meanwhile, or unreadable: its reason
                continue
            if isinstance(st, OSError):
                skip(parts, f"cannot be read ({st.strerror or st})")
                continue
            try:  # (a link is neither a folder nor a file here: not followed)
                if stat.S_ISDIR(st.st_mode):
                    if _skipped_dir(name) or _ignored(specs, prefix + parts, True):
                        continue
                    if not_utf8(name):
                        skip(parts, "is a folder whose name is not UTF-8")
                    else:
                        stack.append((folder / name, parts, specs, (st.st_dev, st.st_ino)))
                elif (
                    stat.S_ISREG(st.st_mode)
                    and _wanted_name(name)
                    and not _ignored(specs, prefix + parts, False)
                ):
                    if st.st_size == 0:
                        continue  # nothing to index, and nothing worth saying
                    reason = (
                        "has a name that is not UTF-8"
                        if not_utf8(name)
                        else _check_file(folder / name, max_bytes)
                    )
                    if reason is None:
                        found.append(given.joinpath(*parts))
                    elif reason != EMPTY:
                        skip(parts, reason)
            except OSError as e:  # vanished or unreadable meanwhile: not part of the listing
                if not isinstance(e, FileNotFoundError):
                    skip(parts, f"cannot be read ({e.strerror or e})")
                continue
    return sorted(found)


_Entry = tuple[str, os.stat_result | OSError | None]
"""A name in a folder and its own status (not followed); None: gone; an error: unreadable."""


def _entries(folder: Path, identity: tuple[int, int]) -> list[_Entry] | None:
    """The entries of `folder` if it is still the folder the listing saw (device and inode),
    else None: opened without following a link, and compared once open, so that a folder
    swapped for a link to elsewhere (or a parent of it) is not walked. It was: a file outside
    the roots was listed, then failed the whole import as a bug. Each entry's status is taken
    while the folder is open (through it: an entry of a descriptor reads it later)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != identity:
            return None
        found: list[_Entry] = []
        for entry in os.scandir(fd):
            try:
                found.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                found.append((entry.name, None))
            except OSError as e:
                found.append((entry.name, e))
        return found
    finally:
        os.close(fd)


# A declared encoding (PEP 263, and Emacs's and Vim's `-*- coding: ... -*-`, `fileencoding=`):
# a comment on the first line, or on the second after a comment or blank first line.
_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")
_BLANK_OR_COMMENT = re.compile(rb"^[ \t\f]*(?:[#\r\n]|$)")


def _declared(data: bytes) -> str | None:
    """The character set a file's coding comment names, if Python has a codec for it."""
    lines = data[:1024].splitlines()[:2]
    for n, line in enumerate(lines):
        if n == 1 and not _BLANK_OR_COMMENT.match(lines[0]):
            break
        if found := _CODING.match(line):
            try:
                info = codecs.lookup(found.group(1).decode("ascii"))
            except (LookupError, UnicodeDecodeError):
                return None
            text = getattr(info, "_is_text_encoding", True)  # not base64, zlib, rot13...
            if not text or info.name in NOT_CHARSETS:
                return None
            # The line that declares it must read the same in it (as Python requires): EBCDIC
            # (cp037) read a Latin-1 file as garbage, indexed.
            declaration = line[: found.end()]  # (the rest may be text in that codec)
            try:
                same = declaration.decode(info.name) == declaration.decode("latin-1")
            except (UnicodeDecodeError, ValueError):
                same = False
            return info.name if same else None
    return None


def read_code(path: str | Path, settings: FilesSettings) -> str:
    """The text of a source file under the allowed roots (the guard files have:
    `read_under_roots`): UTF-8, or UTF-16/32 with a byte-order mark (a BOM is dropped), or
    what its coding comment declares when it is not UTF-8 (`# -*- coding: latin-1 -*-`, legal
    Python 3); never binary; newlines normalised to `\\n` so that chunk offsets and line
    numbers mean the same thing whatever the line endings."""
    _, data = read_under_roots(path, settings)
    if _binary(data[:_SNIFF]):
        raise InvalidInput(f"{path}: binary, not source code")
    try:
        text = _decoded(data)
    except _NotText as e:
        raise InvalidInput(f"{path}: {e}") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


class _NotText(Exception):
    """Bytes `read_code` does not take as text; the message says why."""


def _decoded(data: bytes, *, final: bool = True) -> str:
    """`data` as text, as `read_code` reads it: UTF-16/32 after a byte-order mark, else UTF-8,
    else what a coding comment declares. `final=False`: `data` is the start of a file (cut
    anywhere)."""
    wide = _wide(data)
    encoding, skip = wide or ("utf-8-sig", 0)
    try:
        return codecs.getincrementaldecoder(encoding)().decode(data[skip:], final)
    except UnicodeDecodeError as e:
        declared = None if wide else _declared(data)
        if declared is None or declared in ("utf-8", "utf-8-sig"):
            label = encoding.upper() if wide else "UTF-8"
            raise _NotText(f"is not {label} text (byte {skip + e.start})") from None
        try:
            return codecs.getincrementaldecoder(declared)().decode(data, final)
        except (UnicodeDecodeError, UnicodeError) as d:
            at = f" (byte {d.start})" if isinstance(d, UnicodeDecodeError) else ""
            raise _NotText(f"is not UTF-8, nor the {declared} it declares{at}") from None
