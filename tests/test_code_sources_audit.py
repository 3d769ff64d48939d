"""Listing code under the roots against a review's attacks (tests/: an attacker controls the
files): a FIFO swapped in after the listing's look (it hung for good), a folder swapped for a
link to elsewhere (a file outside the roots listed, then the import failed as a bug), a
`.gitignore` that is a FIFO, a link out of the roots, 1 MB of one line or a sparse file of
NULs, one folder that cannot be read (it failed the whole import), and Python's tree of a long
module (some 400 times its text)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from worker.chunking import code as code_chunking
from worker.sources import code
from worker.sources.code import GITIGNORE_LINE_MAX, GITIGNORE_MAX, list_code_files


def _git_ignored(root: Path) -> set[str]:
    """What `git status` says is ignored in `root` (made a repository here)."""
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    status = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--ignored", "-uall", "-z"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    return {e[3:] for e in status.split("\0") if e.startswith("!! ")}


def _listed(root: Path) -> tuple[list[str], dict[str, str]]:
    skipped: list[tuple[Path, str]] = []
    found = list_code_files(root, skipped=skipped)
    return [str(p.relative_to(root)) for p in found], {
        str(p.relative_to(root)): why for p, why in skipped
    }


@pytest.mark.timeout(10)
def test_a_fifo_where_a_source_file_was_is_no_file_and_never_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "a.py")
    assert code._check_file(tmp_path / "a.py", 1000) is not None  # it blocked on open


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["fifo", "link out", "too large", "long line", "directory"])
def test_a_gitignore_that_cannot_be_used_leaves_its_folder_out_and_says_so(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("a = 1\n")
    (root / "sub" / "b.py").write_text("b = 1\n")
    (tmp_path / "outside").write_text("*.py\n")
    ignore = root / "sub" / ".gitignore"
    if kind == "fifo":
        os.mkfifo(ignore)
    elif kind == "link out":  # git refuses one too; this one hid every file below
        ignore.symlink_to(tmp_path / "outside")
    elif kind == "too large":
        with ignore.open("wb") as f:  # sparse: no disk, minutes to read and compile
            f.truncate(GITIGNORE_MAX + 1)
    elif kind == "long line":
        ignore.write_text("*" + "a" * GITIGNORE_LINE_MAX + "\n")
    else:
        ignore.mkdir()
    found, skipped = _listed(root)
    assert found == ["a.py"]
    assert (
        list(skipped) == ["sub/.gitignore"]
        and "its folder is left out" in skipped["sub/.gitignore"]
    )


def test_a_folder_swapped_for_a_link_during_the_listing_is_not_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("a = 1\n")
    (root / "sub" / "b.py").write_text("b = 1\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text("KEY = 'secret'\n")
    entries = code._entries

    def swapping(folder: Path, identity: tuple[int, int]) -> object:
        listed = entries(folder, identity)
        if folder == root.resolve():  # listed as a folder; then a link takes its place
            (root / "sub").rename(tmp_path / "moved")
            (root / "sub").symlink_to(outside)
        return listed

    monkeypatch.setattr(code, "_entries", swapping)
    found, skipped = _listed(root)
    assert found == ["a.py"] and "sub" in skipped, (found, skipped)


def test_a_folder_that_cannot_be_read_is_skipped_and_the_rest_listed(tmp_path: Path) -> None:
    """Past PATH_MAX (a tree 20 folders of 250 bytes deep), the `.gitignore` look raised out
    of the listing: `error: File name too long`, and no file was added."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "top.py").write_text("t = 1\n")
    fd = os.open(root, os.O_RDONLY)
    try:  # (made a level at a time: the whole path is too long for one call)
        for level in range(20):
            os.mkdir("d" * 250, dir_fd=fd)
            below = os.open("d" * 250, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = below
            if level == 2:
                with open(os.open("mid.py", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
                    f.write("m = 1\n")
    finally:
        os.close(fd)
    found, skipped = _listed(root)
    assert "top.py" in found and any(f.endswith("mid.py") for f in found)
    assert skipped and all("cannot be read" in why for why in skipped.values())


def test_a_long_python_module_is_cut_by_blocks_without_its_tree(monkeypatch) -> None:
    """8 MB of `x = 1` lines took 3.4 GB as Python's tree (the code files' limit is 50 MB)."""
    parsed: list[int] = []
    parse = ast.parse

    def counting(text: str, *args: object, **kwargs: object) -> ast.Module:
        parsed.append(len(text))
        return parse(text, *args, **kwargs)

    monkeypatch.setattr(code_chunking.ast, "parse", counting)
    text = "".join(f"x_{n} = {n}\n" for n in range(60_000))  # about 700 KB
    chunks = code_chunking.chunk_code(text, "big.py")
    assert parsed == []
    assert "".join(c.content for c in chunks).replace("\n", "") == text.replace("\n", "")
    code_chunking.chunk_code("def f():\n    return 1\n", "small.py")
    assert parsed  # a module of ordinary size still has its tree


def test_a_worktree_whose_git_is_a_file_is_listed(tmp_path: Path) -> None:
    """Its `.git/info/exclude` gave ENOTDIR: the whole import was refused."""
    root = tmp_path / "wt"
    root.mkdir()
    (root / ".git").write_text("gitdir: /elsewhere/.git/worktrees/wt\n")
    (root / "a.py").write_text("a = 1\n")
    assert _listed(root) == (["a.py"], {})


def test_a_link_to_a_file_named_directly_is_taken(tmp_path: Path) -> None:
    (tmp_path / "real.py").write_text("r = 1\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "real.py")
    assert list_code_files(tmp_path / "link.py") == [tmp_path / "link.py"]


def test_a_declaration_followed_by_text_in_its_own_codec_is_taken(tmp_path: Path) -> None:
    from worker.settings import FilesSettings
    from worker.sources.code import read_code

    text = "# -*- coding: cp1252 -*- \u2019s\nx = '\u20ac'\n"
    (tmp_path / "m.py").write_bytes(text.encode("cp1252"))
    assert read_code(tmp_path / "m.py", FilesSettings(roots=[tmp_path])) == text


@pytest.mark.timeout(20)
def test_a_gitignore_line_that_backtracks_is_matched_in_linear_time(tmp_path: Path) -> None:
    """`*a*a*...*.py` against a long name that does not match: Python's `re` took 51 s for
    eight stars and a 60-character name, and a hostile tree hung the import for good."""
    (tmp_path / ".gitignore").write_text("*a" * 12 + "*.py\n")
    for name in ("a" * 12 + ".py", "a" * 11 + ".py", "a" * 200 + ".rs"):
        (tmp_path / name).write_text("x = 1\n")
    assert _listed(tmp_path) == (sorted(["a" * 11 + ".py", "a" * 200 + ".rs"]), {})


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to compare with")
def test_patterns_git_never_matches_are_no_error_and_the_rest_applies_as_git_does(
    tmp_path: Path,
) -> None:
    """A line ending in `\\`, a reversed range or an unclosed bracket: pathspec raised on two
    of them (the import failed); git matches nothing with any of them."""
    lines = ["foo\\", "[z-a].py", "*.py[", "x.py", "[!a]b.py", "\\#c.py", "d\\ .py", "!keep.py"]
    names = ["a.py", "x.py", "foo\\", "ab.py", "bb.py", "#c.py", "d .py", "keep.py", "[z-a].py"]
    (tmp_path / ".gitignore").write_text("\n".join(lines) + "\n")
    for name in names:
        (tmp_path / name).write_text("x = 1\n")
    ignored = _git_ignored(tmp_path)
    found, skipped = _listed(tmp_path)
    wanted = {n for n in names if n.endswith(".py")}
    assert ignored == {"x.py", "bb.py", "#c.py", "d .py"}  # (what git says, held here)
    assert (set(found), skipped) == (wanted - ignored, {})


def test_a_gitignore_of_thousands_of_patterns_is_matched_whole_last_match_deciding(
    tmp_path: Path,
) -> None:
    """RE2 cannot compile a set of a few thousand patterns: they are matched in several, and
    a `!` past the first set still overrides a pattern in it."""
    lines = [f"gen{i}.py" for i in range(3000)] + ["!gen5.py", "other*.py"]
    (tmp_path / ".gitignore").write_text("\n".join(lines) + "\n")
    for name in ("gen5.py", "gen7.py", "gen2999.py", "gen3000.py", "other1.py"):
        (tmp_path / name).write_text("x = 1\n")
    assert _listed(tmp_path) == (["gen3000.py", "gen5.py"], {})
    assert len(code._load_spec(tmp_path / ".gitignore", code._Budget(60)) or []) > 1


def test_names_that_are_not_utf8_are_matched_against_the_patterns(tmp_path: Path) -> None:
    """RE2 takes UTF-8: a folder's name that is not (a lone surrogate in Python) raised."""
    root = os.fsencode(tmp_path)
    (tmp_path / ".gitignore").write_text("?gen/\n*.rs\n")
    os.mkdir(os.path.join(root, b"\xffgen"))
    os.mkdir(os.path.join(root, b"\xfesrc"))
    for name in (b"\xffgen/a.py", b"\xfesrc/b.py", b"\xfdc.rs"):
        with open(os.path.join(root, name), "w") as f:
            f.write("x = 1\n")
    found, skipped = _listed(tmp_path)
    assert found == []
    assert list(skipped) == [os.fsdecode(b"\xfesrc")]  # (gen/ and c.rs: ignored, unsaid)


def test_a_folder_leaves_out_what_a_file_named_alone_is_refused_for(tmp_path: Path) -> None:
    """`kidx add code FOLDER` added a Latin-1 file and random bytes with no NUL, which `kidx
    add code FILE` refused, and each failed at its run. Its start is read as the run reads it:
    a declared codec, a UTF-16 mark, a character cut at 8 KB are still fine."""
    (tmp_path / "latin.py").write_bytes(b"x = '\xe9'\n")
    (tmp_path / "noise.py").write_bytes(bytes(range(128, 256)) * 4)
    (tmp_path / "declared.py").write_bytes(b"# -*- coding: latin-1 -*-\nx = '\xe9'\n")
    (tmp_path / "wide.ps1").write_bytes("\ufeffWrite-Host 'h\u00e9'\n".encode("utf-16"))
    (tmp_path / "cut.py").write_bytes(b"# " + b"a" * 8189 + "\u00e9\n".encode())  # 8 KB ends mid-é
    found, skipped = _listed(tmp_path)
    assert found == ["cut.py", "declared.py", "wide.ps1"]
    assert skipped == {
        "latin.py": "is not UTF-8 text (byte 5)",
        "noise.py": "is not UTF-8 text (byte 0)",
    }


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to compare with")
def test_posix_classes_in_brackets_match_as_git_matches_them(tmp_path: Path) -> None:
    """pathspec wrote `[[:digit:]]` as `[[:digit:]\\]` (other characters), which RE2 refused:
    the folder of such a `.gitignore` was left out, or the whole import refused."""
    lines = [
        "[[:digit:]]*.py",
        "x[[:upper:]].py",
        "*[[:space:]]*.py",
        "p[[:punct:]].py",
        "q[[:alnum:]][[:alpha:]].py",
        "r[![:lower:]].py",
        "g[[:graph:]]g.py",
        "[[:bogus:]]*.py",  # no such class: git matches nothing with it
        "c[[:cntrl:]]c.py",
    ]
    names = ["1a.py", "a1.py", "xA.py", "xa.py", "s p.py", "p!.py", "p].py", "p_.py", "pa.py"]
    names += ["qa1.py", "q1a.py", "rA.py", "ra.py", "g~g.py", "g g.py"]
    (tmp_path / ".gitignore").write_text("\n".join(lines) + "\n")
    for name in names:
        (tmp_path / name).write_text("x = 1\n")
    ignored = _git_ignored(tmp_path)
    found, skipped = _listed(tmp_path)
    assert (set(found), skipped) == (set(names) - ignored, {})
    assert set(names) - ignored == {"a1.py", "xa.py", "pa.py", "qa1.py", "ra.py"}


def test_a_package_file_of_white_space_is_left_out_of_a_listing_without_a_word(tmp_path):
    """A blank `__init__.py` was listed, then failed at every run ("no code to index"), and
    `kidx add code DIR --inline` exited 1 on an ordinary Python package; named alone, it is
    refused as the empty file it is."""
    from worker.errors import InvalidInput

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("\n  \n\t\n")
    (tmp_path / "pkg" / "core.py").write_text("def f():\n    return 1\n")
    skipped: list[tuple[Path, str]] = []
    files = list_code_files(tmp_path, skipped=skipped)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["pkg/core.py"]
    assert skipped == []
    with pytest.raises(InvalidInput, match="is empty"):
        list_code_files(tmp_path / "pkg" / "__init__.py")


def test_a_listing_spends_a_bounded_time_on_gitignore_patterns(tmp_path, monkeypatch):
    """Each hostile `.gitignore` within the size limits (`*a*a*a...` lines) took 10-16 s to
    compile, once for every folder that had one: a tree of them, without end. Past the
    listing's budget (none here), a folder whose patterns are not compiled is left out, said."""
    monkeypatch.setattr(code, "GITIGNORE_SECONDS", 0.0)
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / ".gitignore").write_text("*.log\n")
        (tmp_path / folder / "m.py").write_text("x = 1\n")
    (tmp_path / "top.py").write_text("y = 2\n")
    skipped: list[tuple[Path, str]] = []
    files = list_code_files(tmp_path, skipped=skipped)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["top.py"]
    assert sorted(p.relative_to(tmp_path).as_posix() for p, _ in skipped) == [
        "a/.gitignore",
        "b/.gitignore",
    ]
    assert all("for .gitignore patterns is spent" in why for _, why in skipped)
