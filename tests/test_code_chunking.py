"""Code sources and code chunking: listing real trees (ignore files, vendored folders, binaries,
symlinks), reading, chunks per definition, the fallback, and properties over generated text."""

from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.chunking.code import _BLANK_LINE, TARGET_SIZE, CodeChunk, _split, _trim, chunk_code
from worker.errors import InvalidInput
from worker.settings import FilesSettings
from worker.sources.code import CODE_SUFFIXES, list_code_files, read_code

REPO = Path(__file__).resolve().parents[1]


def write(root: Path, rel: str, content: str | bytes = "x = 1\n") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def rels(root: Path, paths: list[Path]) -> list[str]:
    return [p.relative_to(root).as_posix() for p in paths]


# -- listing ---------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small package in a git work tree, with everything a listing must leave out."""
    root = tmp_path / "proj"
    write(root, ".gitignore", "*.log\nbuild/\nout/\n/secret.py\n*.gen.py\n")
    write(root, ".git/info/exclude", "# local\nexcluded.py\n")
    write(root, ".git/hooks/pre-commit.py")
    write(root, "Makefile", "all:\n\ttrue\n")
    write(root, "README.md", "# proj\n")
    write(root, "package.json", "{}\n")
    write(root, "package-lock.json", "{}\n")
    write(root, "secret.py")
    write(root, "excluded.py")
    write(root, "setup.log")
    write(root, "pkg/__init__.py", "")  # empty
    write(root, "pkg/core.py", "def main():\n    return 1\n")
    write(root, "pkg/secret.py")  # `/secret.py` is anchored to the root
    write(root, "pkg/excluded.py")  # unanchored in info/exclude: ignored everywhere
    write(root, "pkg/data.gen.py")
    write(root, "pkg/blob.py", b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    write(root, "pkg/huge.py", "x = 1\n" * 400)
    write(root, "pkg/debug.log")
    write(root, "pkg/sub/.gitignore", "local_*.py\n/anchored.py\n!keep.gen.py\n")
    write(root, "pkg/sub/mod.ts", "export const a = 1;\n")
    write(root, "pkg/sub/local_conf.py")
    write(root, "pkg/sub/anchored.py")
    write(root, "pkg/sub/keep.gen.py")
    write(root, "pkg/sub/deeper/anchored.py")
    write(root, "pkg/local_top.py")  # the nested `local_*.py` does not reach up here
    write(root, "build/lib/pkg/core.py")
    write(root, "out/gen.py")
    write(root, "node_modules/left-pad/index.js")
    write(root, "vendor/github.com/x/y.go", "package y\n")
    write(root, ".venv/lib/site.py")
    write(root, "pkg/__pycache__/core.cpython-311.py")
    outside = write(tmp_path, "elsewhere/outside.py")
    os.symlink(outside, root / "pkg" / "outside.py")
    os.symlink(outside.parent, root / "linked", target_is_directory=True)
    os.symlink(root / "pkg" / "core.py", root / "pkg" / "alias.py")  # inside: listed once
    return root


EXPECTED = [
    "Makefile",
    "package.json",
    "pkg/core.py",
    "pkg/local_top.py",
    "pkg/secret.py",
    "pkg/sub/deeper/anchored.py",
    "pkg/sub/keep.gen.py",
    "pkg/sub/mod.ts",
]


def test_listing_a_tree_honours_ignore_files_and_skips_what_is_not_source(tree: Path) -> None:
    assert rels(tree, list_code_files(tree, max_bytes=1000)) == EXPECTED


def test_max_bytes_decides_about_large_files(tree: Path) -> None:
    assert "pkg/huge.py" in rels(tree, list_code_files(tree))  # 2400 bytes < the default


def test_listing_accepts_a_string_path_and_returns_paths_under_it(tree: Path) -> None:
    found = list_code_files(str(tree / "pkg" / "sub"))
    # keep.gen.py: the nested negation wins over the root's `*.gen.py`.
    assert found == [
        tree / p for p in ("pkg/sub/deeper/anchored.py", "pkg/sub/keep.gen.py", "pkg/sub/mod.ts")
    ]


def test_a_subfolder_is_listed_with_the_ignore_files_of_its_work_tree(tree: Path) -> None:
    # `*.gen.py` (root .gitignore) and `excluded.py` (.git/info/exclude) apply below pkg/ too.
    assert rels(tree, list_code_files(tree / "pkg", max_bytes=1000)) == [
        "pkg/core.py",
        "pkg/local_top.py",
        "pkg/secret.py",
        "pkg/sub/deeper/anchored.py",
        "pkg/sub/keep.gen.py",
        "pkg/sub/mod.ts",
    ]


def test_an_ignored_folder_named_explicitly_is_listed(tree: Path) -> None:
    assert rels(tree, list_code_files(tree / "out")) == ["out/gen.py"]


def test_a_file_named_directly_is_listed_whatever_its_suffix(tree: Path) -> None:
    assert list_code_files(tree / "README.md") == [tree / "README.md"]
    assert list_code_files(tree / "pkg" / "data.gen.py") == [tree / "pkg" / "data.gen.py"]


@pytest.mark.parametrize(
    ("rel", "reason"),
    [
        ("pkg/blob.py", "binary"),
        ("pkg/__init__.py", "empty"),
        ("pkg/huge.py", "larger than 1000 bytes"),
        ("pkg/missing.py", "no such file"),
    ],
)
def test_a_file_named_directly_is_refused_when_unusable(tree: Path, rel: str, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason):
        list_code_files(tree / rel, max_bytes=1000)


def test_listing_this_repository_worker_package() -> None:
    found = list_code_files(REPO / "worker")
    listed = set(rels(REPO, found))
    assert found == sorted(found)
    assert {
        "worker/pipeline.py",
        "worker/errors.py",
        "worker/chunking/structure.py",
        "worker/chunking/code.py",
        "worker/sources/code.py",
    } <= listed
    assert not any("__pycache__" in p or p.endswith(".pyc") for p in listed)
    expected = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "worker").rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix in CODE_SUFFIXES
        and p.stat().st_size > 0
    }
    assert listed == expected


def test_read_code_drops_the_bom_and_normalises_line_endings(tmp_path: Path) -> None:
    path = write(tmp_path, "a.py", "\ufeffx = 1\r\ny = 'é'\rz = 3\n".encode())
    assert read_code(path, FilesSettings(roots=[tmp_path])) == "x = 1\ny = 'é'\nz = 3\n"


def test_read_code_refuses_what_is_not_utf8_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "latin.py", "s = 'é'\n".encode("latin-1"))
    roots = FilesSettings(roots=[tmp_path])
    with pytest.raises(InvalidInput, match=r"latin\.py"):
        read_code(path, roots)
    with pytest.raises(InvalidInput, match=r"gone\.py"):
        read_code(tmp_path / "gone.py", roots)


# -- chunking: examples ----------------------------------------------------------------------


DEFS = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def def_start(node: ast.stmt) -> int:
    """The first line of a definition: its first decorator."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def only_comments(lines: list[str], first: int, last: int) -> bool:
    """Lines first..last (1-based) are blank or comments."""
    return all(not x.strip() or x.lstrip().startswith("#") for x in lines[first - 1 : last])


@pytest.mark.parametrize("max_size", [10**6, 1500])
def test_a_module_of_this_repository_gives_chunks_per_top_level_definition(max_size: int) -> None:
    text = read_code(REPO / "worker" / "pipeline.py", FilesSettings(roots=[REPO]))
    lines = text.split("\n")
    defs = [n for n in ast.parse(text).body if isinstance(n, DEFS)]
    assert len(defs) >= 3  # the module is edited by others: only a few must remain
    chunks = chunk_code(text, "worker/pipeline.py", max_size=max_size)
    owners = [c.symbol.split(".")[0] for c in chunks if c.symbol]
    assert list(dict.fromkeys(owners)) == [d.name for d in defs]
    for node in defs:
        mine = [c for c in chunks if c.symbol and c.symbol.split(".")[0] == node.name]
        if max_size > len(text):
            assert len(mine) == 1, node.name
        assert mine == chunks[chunks.index(mine[0]) : chunks.index(mine[0]) + len(mine)]
        start = def_start(node)
        assert mine[0].start_line <= start
        assert only_comments(lines, mine[0].start_line, start - 1)
        assert mine[-1].end_line == node.end_lineno
        assert all(len(c.content) <= max_size for c in mine)
    for c in chunks:  # what is not a definition holds no definition's first line
        if c.symbol is None:
            assert not any(c.start_line <= def_start(d) <= c.end_line for d in defs)


def test_module_statements_are_grouped_but_definitions_never_merged() -> None:
    text = "import os\nimport sys\n\nX = 1\nY = 2\n\n\ndef a():\n    pass\n\n\ndef b():\n    pass\n"
    chunks = chunk_code(text, "m.py")
    assert [(c.symbol, c.start_line, c.end_line) for c in chunks] == [
        (None, 1, 5),
        ("a", 8, 9),
        ("b", 12, 13),
    ]
    consts = "".join(f"CONSTANT_{i} = {i}\n" for i in range(200))
    grouped = chunk_code(consts, "c.py")
    assert 3 < len(grouped) < 200 // 4  # grouped, up to the target, an anchor starting one
    assert all(len(c.content) <= TARGET_SIZE for c in grouped)


@pytest.mark.parametrize("lines", [3, 10, 28])
def test_a_block_added_at_the_top_leaves_the_later_chunks_as_they_were(lines: int) -> None:
    """Blocks packed greedily from the top: one function added near the start of a Go file
    shifted every later group, and re-embedded up to the whole file (the LESSONS trap)."""
    funcs = [
        f"func f{i}() int {{\n"
        + "".join(f"    x{j} := g{i}({j})\n" for j in range(2 + i % 7))
        + "    return x0\n}\n"
        for i in range(300)
    ]
    before = chunk_code("package main\n\n" + "\n".join(funcs), "main.go")
    added = "func added() {\n" + "    y := 1\n" * lines + "}\n\n"
    after = chunk_code("package main\n\n" + added + "\n".join(funcs), "main.go")
    assert len({c.content for c in after} - {c.content for c in before}) <= 3


def test_decorators_and_comments_above_belong_to_the_definition() -> None:
    text = "import x\n\n# why f exists\n# more\n@cache\n@other(1)\ndef f():\n    return 1\n"
    chunks = chunk_code(text, "m.py")
    assert [c.symbol for c in chunks] == [None, "f"]
    assert chunks[1].content.startswith("# why f exists\n# more\n@cache")
    assert (chunks[1].start_line, chunks[1].end_line) == (3, 8)


def test_a_section_comment_between_definitions_goes_with_the_next_one() -> None:
    text = "def a():\n    pass\n\n\n# -- helpers --\n\n\ndef b():\n    pass\n\n# trailing\n"
    chunks = chunk_code(text, "m.py")
    assert [(c.symbol, c.content) for c in chunks] == [
        ("a", "def a():\n    pass"),
        ("b", "# -- helpers --\n\n\ndef b():\n    pass"),
        (None, "# trailing"),
    ]
    # Code between them is not a comment: the comment stays with the module-level code.
    text = "def a():\n    pass\n\n# about X\nX = 1\n\n# why b\ndef b():\n    pass\n"
    assert [c.content for c in chunk_code(text, "m.py")] == [
        "def a():\n    pass",
        "# about X\nX = 1",
        "# why b\ndef b():\n    pass",
    ]


def test_statements_sharing_a_line_are_taken_once() -> None:
    for text in ("a = 1; b = 2\n", "x = (1,\n     2); y = 3\ndef f():\n    pass\n"):
        for max_size in (4, 6, 1500):
            check_chunks(text, chunk_code(text, "m.py", max_size=max_size), max_size)


def test_python_with_lone_carriage_returns_uses_the_fallback() -> None:
    # `ast` counts `\r` as a line break, `\n` alone is counted here: its line numbers would
    # put `x = 2` into the chunk of `f`.
    text = "def f():\r    return 1\rx = 2\n"
    assert [(c.symbol, c.content) for c in chunk_code(text, "m.py")] == [(None, text[:-1])]


BIG_CLASS = (
    "import abc\n\n\n# The big one.\n@register\nclass Big(abc.ABC):\n"
    '    """A class with many methods."""\n\n    LIMIT = 10\n\n'
    + "".join(
        f"    def method_{i}(self, value: int) -> int:\n"
        f'        """Method {i}: add {i}, then check the limit of the class."""\n'
        f"        result = value + {i}\n"
        f"        if result > self.LIMIT:\n"
        f"            raise ValueError(result)\n"
        f"        return result\n\n"
        for i in range(12)
    )
    + "    DOC = '''\n# not a comment'''\n"  # its last line only looks like one
    + "    # static helper\n    @staticmethod\n    def helper() -> None:\n        pass\n\n"
    + "    ALIASES = {'m': 'method_0'}\n\n\nclass Small:\n    x = 1\n"
)


def test_a_large_class_is_split_by_method() -> None:
    chunks = chunk_code(BIG_CLASS, "big.py")
    assert [c.symbol for c in chunks] == [
        None,
        "Big",
        *(f"Big.method_{i}" for i in range(12)),
        "Big",
        "Big.helper",
        "Big",
        "Small",
    ]
    header = chunks[1]
    assert header.content.startswith("# The big one.\n@register\nclass Big(abc.ABC):")
    assert header.content.endswith("LIMIT = 10")
    for c in chunks[2:14]:
        assert c.content.startswith(f"    def {c.symbol.split('.')[1]}(self")
        assert c.content.endswith("return result")
    assert chunks[14].content == "    DOC = '''\n# not a comment'''"
    assert chunks[15].content.startswith("    # static helper\n    @staticmethod")
    assert chunks[16].content == "    ALIASES = {'m': 'method_0'}"
    assert chunks[17].content == "class Small:\n    x = 1"
    whole = chunk_code(BIG_CLASS, "big.py", max_size=10**5)
    assert [c.symbol for c in whole] == [None, "Big", "Small"]


def test_a_long_function_is_split_by_whole_lines() -> None:
    body = "".join(f"    value_{i} = compute({i}, option={i * 7})\n" for i in range(80))
    text = f"def long():\n{body}    return value_0\n"
    chunks = chunk_code(text, "long.py")
    assert len(chunks) >= 3
    assert {c.symbol for c in chunks} == {"long"}
    for c in chunks:
        assert len(c.content) <= 1500
        assert c.start == 0 or text[c.start - 1] == "\n"  # starts at a line start
        assert text[c.end] == "\n"  # ends at a line end
    assert "".join(c.content + "\n" for c in chunks) == text


def test_a_long_function_is_split_preferably_at_blank_lines() -> None:
    blocks = ["".join(f"    step_{b}_{i} = run({b}, {i})\n" for i in range(5)) for b in range(12)]
    text = "def staged():\n" + "\n".join(blocks)
    chunks = chunk_code(text, "staged.py", max_size=500)
    assert len(chunks) >= 4
    for c in chunks[:-1]:
        assert text[c.end : c.end + 2] == "\n\n"  # each part ends where a block does


def test_a_line_longer_than_the_maximum_is_cut_hard() -> None:
    text = "X = '" + "a" * 400 + "'\n"
    chunks = chunk_code(text, "x.py", max_size=120)
    assert [len(c.content) for c in chunks] == [120, 120, 120, 46]
    assert "".join(c.content for c in chunks) == text.strip()


GO = """package main

import "fmt"

// Greeter says hello.
type Greeter struct {
	name string
}

func (g Greeter) Hello() string {
	return fmt.Sprintf("hello, %s", g.name)
}

func main() {
	g := Greeter{name: "world"}

	fmt.Println(g.Hello())
}
"""


def test_go_goes_through_the_fallback_at_top_level_blocks() -> None:
    text = GO * 4
    chunks = chunk_code(text, "main.go", max_size=300)
    assert len(chunks) >= 4
    for c in chunks:
        assert c.symbol is None
        assert c.start == 0 or text[c.start - 2 : c.start] == "\n\n"  # col 0 after a blank line
        assert len(c.content) <= 300
        # The blank line inside main() is indented: not a boundary, main() stays whole.
        assert c.content.count("func main() {") == c.content.count("g.Hello())\n}")
    assert chunks[0].content.startswith("package main\n\nimport")
    assert len(chunk_code(GO, "main.go")) == 1  # small blocks are packed


def test_the_fallback_splits_an_oversized_block_by_lines() -> None:
    text = "function f() {\n" + "".join(f"  call({i});\n" for i in range(300)) + "}\n"
    chunks = chunk_code(text, "f.js")
    assert len(chunks) > 2
    assert all(len(c.content) <= 1500 and text[c.end] == "\n" for c in chunks)


def test_python_that_does_not_parse_uses_the_fallback() -> None:
    text = "import os\n\ndef broken(:\n    pass\n\n\ndef fine():\n    return 1\n"
    chunks = chunk_code(text, "broken.py", max_size=25)
    assert [c.content for c in chunks] == [
        "import os",
        "def broken(:\n    pass",
        "def fine():\n    return 1",
    ]
    assert all(c.symbol is None for c in chunks)


def test_the_language_is_chosen_by_the_path() -> None:
    text = "def f():\n    return 1\n"
    assert [c.symbol for c in chunk_code(text, "pkg/m.py")] == ["f"]
    assert [c.symbol for c in chunk_code(text, "stub.PYI")] == ["f"]
    assert [c.symbol for c in chunk_code(text, "m.js")] == [None]


def test_line_numbers_and_embedding_input() -> None:
    text = "\n\nimport os\n\n\ndef f():\n    return os.sep\n\n"
    chunks = chunk_code(text, "m.py")
    assert chunks == [
        CodeChunk(0, 2, 11, 3, 3, "import os", None),
        CodeChunk(1, 14, 40, 6, 7, "def f():\n    return os.sep", "f"),
    ]
    assert chunks[1].embedding_input("pkg/m.py") == "pkg/m.py:6-7 f\n\n" + chunks[1].content
    assert chunks[0].embedding_input("pkg/m.py") == "pkg/m.py:3-3\n\nimport os"
    assert chunk_code(" \n\t\n", "m.py") == []


# -- chunking: properties --------------------------------------------------------------------

names = st.sampled_from(["a", "run", "Config", "_helper", "load_all", "x1"])
body_line = st.sampled_from(
    ["x = 1", "return x", "pass", "# note", "", "y = f(x,\n    z)", "s = '''\n# in string'''"]
)


@st.composite
def functions(draw: st.DrawFn, indent: str = "") -> str:
    head = draw(st.sampled_from(["", "@deco\n", "# about it\n", "@a\n@b(1)\n", "# c\n\n"]))
    body = draw(st.lists(body_line, min_size=1, max_size=40))
    lines = "\n".join("    " + x if x else x for x in ["pass", *body])
    return textwrap.indent(f"{head}def {draw(names)}(x):\n{lines}\n", indent)


@st.composite
def classes(draw: st.DrawFn) -> str:
    attribute = st.sampled_from(["    A = 1\n", "    B = '''\n# in string'''\n"])
    members = draw(st.lists(st.one_of(functions("    "), attribute), max_size=8))
    return f"class {draw(names)}:\n" + ("".join(members) or "    pass\n")


valid_statement = st.one_of(
    st.sampled_from(
        [
            "import os",
            "from x import (\n    a,\n    b,\n)",
            "X = 1",
            "a = 1; b = 2",
            "if X:\n    pass",
            '"""doc\n# not a comment"""',
            "# comment",
            "",
            "   ",
            "\x0c",
        ]
    ),
    functions(),
    classes(),
    st.integers(0, 300).map(lambda n: "Y = '" + "w " * n + "'"),
)
garbage = st.one_of(st.sampled_from(["def (:", "}", "\tdef"]), st.text(max_size=20))
valid_python = st.lists(valid_statement, max_size=20).map("\n".join)
python_like = st.lists(st.one_of(valid_statement, garbage), max_size=20).map("\n".join)
sizes = st.one_of(st.sampled_from([1500, 120, 8]), st.integers(1, 2000))
paths = st.sampled_from(["m.py", "m.pyi", "m.go", "m.txt"])
PROPS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_chunks(text: str, chunks: list[CodeChunk], max_size: int) -> None:
    assert [c.index for c in chunks] == list(range(len(chunks)))
    covered: list[int] = []
    previous_end = 0
    for c in chunks:
        assert c.content == text[c.start : c.end]
        assert c.content.strip() and not c.content[-1].isspace()
        assert len(c.content) <= max_size
        assert c.start >= previous_end  # ascending, never overlapping
        previous_end = c.end
        assert c.start_line == text.count("\n", 0, c.start) + 1
        assert c.end_line == text.count("\n", 0, c.end - 1) + 1
        covered.extend(i for i in range(c.start, c.end) if not text[i].isspace())
    assert covered == [i for i, ch in enumerate(text) if not ch.isspace()]


@PROPS
@given(valid_python, sizes)
def test_properties_over_valid_python(text: str, max_size: int) -> None:
    chunks = chunk_code(text, "gen.py", max_size=max_size)
    check_chunks(text, chunks, max_size)
    starts = [0, *(i + 1 for i, ch in enumerate(text) if ch == "\n")]
    for node in ast.parse(text).body:  # each definition's keyword is in a chunk named after it
        at = starts[node.lineno - 1] + node.col_offset  # the generated text is ASCII
        owner = [c for c in chunks if c.start <= at < c.end]
        if isinstance(node, DEFS):
            assert [c.symbol.split(".")[0] for c in owner] == [node.name]
        else:
            assert all(c.symbol is None for c in owner)


@PROPS
@given(python_like, sizes)
def test_properties_over_python_like_text(text: str, max_size: int) -> None:
    chunks = chunk_code(text, "gen.py", max_size=max_size)
    check_chunks(text, chunks, max_size)
    assert chunk_code(text, "gen.py", max_size=max_size) == chunks


@PROPS
@given(st.text(), sizes, paths)
def test_properties_over_arbitrary_text(text: str, max_size: int, path: str) -> None:
    chunks = chunk_code(text, path, max_size=max_size)
    check_chunks(text, chunks, max_size)
    assert chunk_code(text, path, max_size=max_size) == chunks


@PROPS
@given(st.lists(st.one_of(python_like, st.text(max_size=50)), max_size=3).map("\r\n".join))
def test_properties_with_carriage_returns(text: str) -> None:
    check_chunks(text, chunk_code(text, "cr.py", max_size=120), 120)


def split_by_trimming(text: str, s: int, e: int, max_size: int) -> list[tuple[int, int]]:
    """`_split` as it was: the rest trimmed with `_trim` after each cut (a copy of the whole rest
    each time: quadratic on a long block, 15 MB of short lines took 24 s; but obviously right)."""
    parts: list[tuple[int, int]] = []
    s, e = _trim(text, s, e)
    while s < e:
        if e - s <= max_size:
            parts.append((s, e))
            break
        limit, cut = s + max_size, -1
        for m in _BLANK_LINE.finditer(text, s + max_size // 2, limit):
            cut = m.start()
        if cut <= s:
            cut = text.rfind("\n", s + 1, limit + 1)
        if cut <= s:
            cut = limit
        a, b = _trim(text, s, cut)
        if a < b:
            parts.append((a, b))
        s, e = _trim(text, cut, e)
    return parts


@PROPS
@given(
    st.lists(st.sampled_from(["x = 1", "", "  ", "\t  y", "  # c", "z" * 30, " \x0c"]), max_size=80)
    .map("\n".join)
    .flatmap(lambda t: st.tuples(st.just(t), st.integers(0, len(t)), st.integers(0, len(t)))),
    st.integers(1, 60),
)
def test_splitting_a_long_block_cuts_where_trimming_the_rest_each_time_did(
    case: tuple[str, int, int], max_size: int
) -> None:
    text, s, e = case
    assert _split(text, s, e, max_size) == split_by_trimming(text, s, e, max_size)
