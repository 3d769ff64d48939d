"""A heading path as stored (`note_chunks.headings`, the titles joined by " > ") and as a hit
gives it back (`ChunkHit.headings`): a heading holding " > " ("When n > 0") came back as two
titles, "When n" and "0"."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from conftest import FakeEmbedder
from worker.bulk import index_item
from worker.chunking import heading_path, heading_titles
from worker.retrieval import search_chunks
from worker.store.items import add_item

# Titles as the chunker makes them (one line each), rich in what the escape is about.
TITLES = st.lists(
    st.text(alphabet=st.sampled_from(["a", " ", ">", "\\", "<", "é"]), max_size=8)
    | st.text(st.characters(exclude_characters="\r\n"), max_size=12),
    min_size=1,
    max_size=5,
).filter(lambda t: t != [""])


@given(TITLES)
def test_every_path_reads_back_as_its_titles(titles: list[str]) -> None:
    assert heading_titles(heading_path(titles)) == titles


@given(st.lists(st.text(st.characters(exclude_characters="\r\n>")), min_size=1, max_size=5))
def test_a_path_without_a_gt_is_stored_as_before(titles: list[str]) -> None:
    """What every index holds already: ordinary headings are stored as they always were."""
    assert heading_path(titles) == " > ".join(titles)


def test_a_heading_holding_the_separator_comes_back_whole(db) -> None:
    body = "Some text under the heading, long enough to be a chunk of its own. " * 12
    text = f"# Loops\n\n{body}\n\n## When n > 0\n\n{body}\n\n### Details\n\nDetails here. {body}"
    item = add_item(db, kind="note", title="Loops", content=text)
    fake = FakeEmbedder()
    index_item(db, item, embedder=fake)
    found = search_chunks(db, "details here", None, k=3, mode="keyword")
    assert found.hits[0].headings == ["Loops", "When n > 0", "Details"]
    # what the embedder was given is the path as written: the escape is the column's alone
    sent = [t for call in fake.calls for t in call if "Details here" in t]
    assert sent and "Loops > When n > 0 > Details" in sent[0] and "\\>" not in sent[0]
