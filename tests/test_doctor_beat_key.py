"""`kidx doctor`'s beat check when beat's heartbeat key holds what beat never wrote: a list,
a hash, or text that is no time (a host sharing the Redis database). It failed with a bare
`ResponseError: WRONGTYPE ...` or `ValueError: could not convert string to float`, or said
`heartbeat nan s ago`; now one line naming the key and who to look for. Real Redis, this
process's spare database (tests/stack.py), no beat running."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from ops.doctor import Fail, check_beat
from scheduler.beat import HEARTBEAT_KEY, LEASE_KEY
from stack import SPARE_DB, broker_url
from worker.settings import load_settings


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(broker_url(SPARE_DB))
    r.delete(HEARTBEAT_KEY, LEASE_KEY)
    yield r
    r.delete(HEARTBEAT_KEY, LEASE_KEY)
    r.close()


@pytest.mark.parametrize(
    ("write", "shown"),
    [
        (lambda r: r.rpush(HEARTBEAT_KEY, "x"), "holds a list"),
        (lambda r: r.hset(HEARTBEAT_KEY, "a", "b"), "holds a hash"),
        (lambda r: r.set(HEARTBEAT_KEY, "hello world"), "holds b'hello world'"),
        (lambda r: r.set(HEARTBEAT_KEY, "nan host:1"), "holds b'nan host:1'"),
        (lambda r: r.set(HEARTBEAT_KEY, b"\xff\xfe"), "holds b'\\xff\\xfe'"),
    ],
)
def test_a_heartbeat_beat_never_wrote_is_named_in_one_line(client, write, shown):
    write(client)
    settings = load_settings(broker_url=broker_url(SPARE_DB))
    with pytest.raises(Fail) as e:
        check_beat(settings, 2.0)
    assert e.value.detail.startswith(f"{HEARTBEAT_KEY} {shown}, not beat's heartbeat"), e.value
    assert "\n" not in e.value.detail and "another program writes it" in e.value.detail


def test_a_fresh_heartbeat_is_ok_and_none_says_to_start_beat(client):
    settings = load_settings(broker_url=broker_url(SPARE_DB))
    with pytest.raises(Fail, match="no beat heartbeat"):
        check_beat(settings, 2.0)
    client.set(HEARTBEAT_KEY, "1e30 host:1")  # it said "heartbeat 0 s ago"
    with pytest.raises(Fail, match="in the future"):
        check_beat(settings, 2.0)
    import time

    client.set(HEARTBEAT_KEY, f"{time.time():.0f} host:42")
    assert check_beat(settings, 2.0).endswith("from host:42")


@pytest.mark.parametrize(
    ("write", "shown"),
    [
        (lambda r: r.set(LEASE_KEY, "host:1"), "holds a string that never expires"),
        (lambda r: r.rpush(LEASE_KEY, "x"), "holds a list"),
    ],
)
def test_a_lease_that_is_no_beat_s_fails_the_beat_check_naming_the_key(client, write, shown):
    """Beat followed such a value for good, sending no sweep, while its heartbeat (written
    at every tick all the same) made the check say all was well."""
    import time

    client.set(HEARTBEAT_KEY, f"{time.time():.0f} host:42")
    settings = load_settings(broker_url=broker_url(SPARE_DB))
    assert check_beat(settings, 2.0).endswith("from host:42")
    write(client)
    with pytest.raises(Fail) as e:
        check_beat(settings, 2.0)
    assert f"{LEASE_KEY} {shown}" in e.value.detail and "DEL" in e.value.detail
    client.delete(LEASE_KEY)
    client.set(LEASE_KEY, "host:42", ex=30)  # a beat's lease: fine
    assert check_beat(settings, 2.0).endswith("from host:42")
