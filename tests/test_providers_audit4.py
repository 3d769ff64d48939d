"""Providers against a fourth review: a chat answer that takes the fence pattern quadratic
time, a batch that times out whole, and a provider that starts refusing every text."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from worker.providers.chat import _unwrapped


@contextmanager
def bounded(seconds: int) -> Iterator[None]:
    """SIGALRM after `seconds`: a pattern that backtracks without end fails the test rather
    than hanging the suite (the work is linear: milliseconds)."""

    def stop(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("blank", [" ", "\t"])
def test_a_fence_followed_by_a_million_blanks_is_unwrapped_in_linear_time(blank: str) -> None:
    """Two blank runs either side of an optional `json` split a run of blanks in as many ways
    as it is long: "```" and 16,000 spaces took 1.3 s, a 1 MB answer hours (the chunk
    deadline does not look at CPU)."""
    answer = "```" + blank * 1_000_000
    with bounded(20):
        assert _unwrapped(answer) == answer  # not a fenced answer: left as it is


@pytest.mark.parametrize("opening", ["```json\n", "```JSON \n", "``` json\t\r\n", "```\n"])
def test_fenced_json_is_still_unwrapped(opening: str) -> None:
    body = json.dumps({"chunks": [{"start": 1, "end": 2}]})
    assert _unwrapped(f"  {opening}{body}\n```  ") == body
