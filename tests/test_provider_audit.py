"""Defects an audit found in the embedding providers, each through the pipeline over real HTTP
(the loopback stand-in, or a small raw server here) and a real SQLite file."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from testkit.standin import StandIn
from worker.bulk import index_item
from worker.errors import BadAnswer, IndexAborted
from worker.indexers.memories import add_memory
from worker.providers.base import EmbeddingModel
from worker.providers.http import parse_retry_after
from worker.store import Database
from worker.store.items import add_item, get_state

ABSURD_DATE = "Mon, 01 Jan 99999999999999999999 00:00:00 GMT"


def _answer_of(numbers: str, count: int = 1) -> bytes:
    data = ",".join(f'{{"index":{i},"embedding":[{numbers}]}}' for i in range(count))
    return f'{{"data":[{data}]}}'.encode()


# -- 1. a JSON integer no float holds --------------------------------------------------------


def test_an_integer_too_large_for_a_float_fails_the_item_with_a_clear_error(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """`np.asarray` raised OverflowError for 1 followed by 400 zeros: the run crashed with a
    traceback and the item kept "OverflowError: ..." as its reason."""
    dims = embedder.dimensions or 0
    standin.raw_answer = (200, {}, _answer_of(",".join(["1" + "0" * 400] + ["0"] * (dims - 1))))
    item = add_item(db, kind="note", title="T", content="A short note about anything at all.")
    with pytest.raises(IndexAborted, match="a number too large for a float"):
        index_item(db, item, embedder=embedder)
    state = get_state(db, item)
    assert state["status"] == "failed"
    assert "too large for a float" in state["last_error"]
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0
    with pytest.raises(BadAnswer, match="too large for a float"):
        add_memory(db, "a memory", embedder)
    assert db.scalar("SELECT count(*) FROM memories") == 0


# -- 2. a Retry-After date no datetime holds -------------------------------------------------


def test_a_429_with_an_absurd_retry_after_date_is_retried_as_usual(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """`parsedate_to_datetime` raised OverflowError on the year 99999999999999999999: the run
    crashed instead of backing off and trying again."""
    standin.fail_status, standin.fail_times, standin.retry_after = 429, 1, ABSURD_DATE
    item = add_item(db, kind="note", title="T", content="A short note about anything at all.")
    assert index_item(db, item, embedder=embedder).status == "indexed"
    assert standin.requests == 2


_DATES = st.builds(
    "{}, {} {} {} {}:{}:{} {}".format,
    st.sampled_from(["Mon", "Sun", "", "Xyz"]),
    st.integers(-(10**25), 10**25),
    st.sampled_from(["Jan", "Feb", "Dec", "Foo"]),
    st.integers(-(10**25), 10**25),
    st.integers(-(10**25), 10**25),
    st.integers(-(10**5), 10**5),
    st.integers(-(10**5), 10**5),
    st.one_of(st.sampled_from(["GMT", "UTC", "-0000", "EST"]), st.integers().map("{:+05d}".format)),
)
_VALUES = st.one_of(
    _DATES,
    st.text(st.characters(min_codepoint=32, max_codepoint=126)),
    st.binary().filter(lambda b: not set(b) & set(b"\r\n\0")),
)


@given(name=st.sampled_from(["retry-after", "retry-after-ms"]), value=_VALUES)
def test_parse_retry_after_never_raises(name: str, value: str | bytes) -> None:
    """Whatever a server writes there, the answer is a wait or no wait, never an exception."""
    wait = parse_retry_after(httpx.Headers({name: value}), now=0.0)
    assert wait is None or (wait >= 0.0 and wait != float("inf"))
