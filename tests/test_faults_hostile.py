"""The fault suite, hostile input and security: bad notes, files, URLs, task arguments and
messages; pickle refused, Flower closed without credentials, no secret in a log
(tests/faultkit.py: the stack and the checks)."""

from __future__ import annotations

import json
import random
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

from faultkit import (
    BIG_NOTE,
    FAULT_DB,
    FLOWER_PASSWORD,
    FLOWER_USER,
    LONG,
    SEED,
    FaultStack,
    fault_stack,
    log_lines,
    paragraph,
    slice_problems,
    store_problems,
    two_pool_processes,
    vector_problems,
)
from faults_report import record
from stack import (
    API_KEY,
    broker_url,
    free_port,
    start_flower,
    wait_for,
)
from tasks import GROUP, NOTE
from tasks.producer import enqueue
from worker.chunking import text_hash
from worker.store.items import add_item

pytestmark = [pytest.mark.fault, pytest.mark.stack]


# -- hostile input --------------------------------------------------------------------------


class Opener:
    """Unpickled, this opens (creates) the file it names: a pickle that runs code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def send_pickle(url: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """Send a task serialised with pickle, as an attacker (or an old client) would."""
    evil = Celery(broker=url, backend=url)
    evil.conf.update(task_serializer="pickle", accept_content=["pickle", "json"])
    task_id = str(uuid.uuid4())
    evil.send_task(name, args=args, kwargs=kwargs, task_id=task_id, serializer="pickle")
    evil.close()
    return task_id


def send_raw_json(url: str, body: bytes) -> str:
    """Send a message with a JSON content type and a body that is not JSON."""
    from kombu import Connection

    task_id = str(uuid.uuid4())
    with Connection(url) as conn:
        producer = conn.Producer()
        producer.publish(
            body,
            routing_key="celery",
            exchange="",
            content_type="application/json",
            content_encoding="utf-8",
            serializer=None,
            headers={
                "id": task_id,
                "task": "GenerateEmbedding",
                "lang": "py",
                "argsrepr": "",
                "kwargsrepr": "",
                "origin": "test",
                "retries": 0,
            },
        )
    return task_id


@dataclass
class Case:
    """One hostile input: how it is sent, and what must come of it.

    expect: `indexed` (its chunks exact slices of `text`), `failed` (the item `failed` with
    `words` in its reason, and the task's FAILURE), `refused` (the task's FAILURE, with `words`),
    or `logged` (no task runs; the worker's log says why, with `words`)."""

    name: str
    expect: str
    words: str = ""
    item: int | None = None
    task_id: str | None = None
    text: str | None = None
    mark: str = ""  # for `logged`: what names the message in the log (Celery's line for a
    # refused pickle names no task id, but quotes the body)


def hostile_cases(s: FaultStack, root: Path) -> list[Case]:
    url = broker_url(FAULT_DB)
    cases: list[Case] = []

    def note(name: str, text: str, expect: str = "indexed", words: str = "") -> None:
        item = add_item(s.db, kind="note", title=name, content=text)
        cases.append(Case(name, expect, words, item, enqueue(s.db, item, app=s.app), text))

    def raw_note(name: str, text: str) -> None:  # written by a host application, unchecked
        item = s.db.scalar(
            "INSERT INTO knowledge_items(kind, title, content) VALUES ('note', ?, ?) RETURNING id",
            (name, text),
        )
        cases.append(Case(name, "empty", "empty", item, enqueue(s.db, item, app=s.app), text))

    def source(name: str, kind: str, where: str, words: str) -> None:
        item = add_item(s.db, kind=kind, title=name, content="", source=where)
        cases.append(Case(name, "failed", words, item, enqueue(s.db, item, app=s.app)))

    def task(name: str, words: str, task: str, *args: Any, **kwargs: Any) -> None:
        cases.append(
            Case(
                name,
                "refused",
                words,
                task_id=s.app.send_task(task, args=list(args), kwargs=kwargs).id,
            )
        )

    rng = random.Random(SEED + 4)
    raw_note("empty note", "")
    raw_note("white space only", " \n\n\t  \n" * 1000)
    big, size = [], 0
    while size < BIG_NOTE:
        part = paragraph(rng, f"big{len(big)}", 4000) + "\n\n"
        if len(big) % 50 == 0:
            part = f"## Big section {len(big)}\n\n" + part
        big.append(part)
        size += len(part)
    note("20 MB note", "".join(big))
    note("1 MB line without a space", "abcdefghij" * 100_000)
    note("NUL bytes", "A note\x00with NUL\x00 bytes in it. " * 200)
    note(
        "deeply nested Markdown",
        "".join(">" * d + f" quote {d}\n" for d in range(1, 400))
        + "\n"
        + "".join("  " * d + f"- item {d}\n" for d in range(400))
        + "\n"
        + "*" * 5000
        + "_" * 5000
        + "[" * 3000
        + "]" * 3000,
    )
    note(
        "10,000 headings",
        "".join(f"{'#' * (1 + h % 6)} Heading {h}\n\nBody {h}.\n\n" for h in range(10_000)),
    )
    note(
        "a fence never closed",
        "Intro.\n\n```python\n" + "".join(f"line_{n} = {n} * 2\n" for n in range(4000)),
    )
    (root / "latin1.md").write_bytes("Caf\xe9 cr\xe8me, not UTF-8.\n".encode("latin-1") * 50)
    source("invalid UTF-8 in a file", "file", str(root / "latin1.md"), "is not UTF-8 text")
    (root / "binary.md").write_bytes(b"\x00\x01\x02binary\x00" * 100)
    source("NUL bytes in a file", "file", str(root / "binary.md"), "binary")
    (root / "empty.md").write_bytes(b"")
    source("an empty file", "file", str(root / "empty.md"), "the file is empty")
    source("a file outside the roots", "file", "/etc/hostname", "outside the allowed folders")
    (root / "escape.md").symlink_to("/etc/passwd")
    source("a symlink out of the roots", "file", str(root / "escape.md"), "outside the allowed")
    source("a file that is not there", "file", str(root / "missing.md"), "no such file")
    source(
        "a URL to a refused address",
        "url",
        f"{s.standin.base_url}/embeddings",
        "is not a public address",
    )
    source(
        "a URL to the metadata service",
        "url",
        "http://169.254.169.254/latest/meta-data/",
        "is not a public address",
    )
    source("a URL that is not http", "url", "file:///etc/passwd", "http")
    must = "the item id must be a 64-bit integer, not "
    task("a non-integer item id", must + "'abc'", "GenerateEmbedding", "abc")
    task("an item id past 64 bits", must + str(2**70), "GenerateEmbedding", 2**70)
    task("a fractional item id", must + "1.5", "GenerateEmbedding", 1.5)
    task("a boolean item id", must + "True", "GenerateEmbedding", True)
    task("no item id", must + "None", "GenerateEmbedding")
    task(
        "an unknown task argument",
        "unknown task argument 'colour'",
        "GenerateEmbedding",
        cases[0].item,
        colour="red",
    )
    task("an unknown task", "NoSuchTask", "NoSuchTask", 1)
    # Bound by Python, these failed with its TypeError before any kidx code ran: no job row.
    twice = "'item_id' given both by position and by name"
    task("an argument given twice", twice, "GenerateEmbedding", cases[0].item, item_id=1)
    # The task's own first parameter by name: Celery's call raised "got multiple values".
    task("an argument named self", "unknown task argument 'self'", NOTE, cases[0].item, self=1)
    task("a group's argument named self", "unknown task argument 'self'", GROUP, [1], self=1)
    task("a group of 1,001 items", "at most 1000 items, not 1001", GROUP, list(range(1, 1002)))
    # Celery's `retries` header, as a host's message may set it: int("abc") raised before the
    # run was recorded, 10**30 could not be stored, -1000 retried a thousand times more.
    for junk in ("abc", [1], 10**30, -1000):
        text = paragraph(rng, f"retries{len(cases)}", 900)
        item = add_item(s.db, kind="note", title=f"retries {junk!r:.20}", content=text)
        sent = s.app.send_task(NOTE, args=[item], retries=junk).id
        cases.append(Case(f"a retries header of {junk!r:.20}", "indexed", "", item, sent, text))
    marker = root.parent / "pickle-ran"
    pickled = send_pickle(url, "GenerateEmbedding", [cases[2].item], {"reason": Opener(marker)})
    cases.append(
        Case(
            "a pickle-serialised message",
            "logged",
            "untrusted content of type pickle",
            task_id=pickled,
            mark=marker.name,
        )
    )
    garbled = send_raw_json(url, b"{this is not json")
    cases.append(
        Case(
            "a message whose JSON does not parse",
            "logged",
            "can't decode",
            task_id=garbled,
            mark=garbled,
        )
    )
    return cases


def test_hostile_input_gets_a_clear_error_or_a_correct_index_and_the_worker_serves_on(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    env = {"KIDX_FILES__ROOTS": str(root), "KIDX_EMBEDDING__BATCH_SIZE": "64"}
    faults, lost, checked = 0, 0, 0
    try:
        with fault_stack(tmp_path, env=env) as s:
            control_text = "# Control\n\n" + "\n\n".join(
                paragraph(random.Random(SEED), f"control{p}", 600) for p in range(5)
            )
            control = s.note("Control", control_text)
            s.app.AsyncResult(enqueue(s.db, control, app=s.app)).get(timeout=60)
            before = snapshot(s.db, control)
            cases = hostile_cases(s, root)
            faults = len(cases)
            assert faults >= 15
            outcomes = {c.name: outcome(s, c) for c in cases}
            lost = sum(1 for v in outcomes.values() if v != "ok")
            assert {k: v for k, v in outcomes.items() if v != "ok"} == {}
            assert not (tmp_path / "pickle-ran").exists()  # the pickle was never loaded
            # What was indexed carries the provider's vector for each chunk's embedder input.
            served = {text_hash(t): t for t in s.standin.texts}
            indexed = [c.item for c in cases if c.expect == "indexed" and c.item is not None]
            assert vector_problems(s.db, served, indexed) == []
            # Nothing else was touched; the worker serves on, with both its processes.
            assert snapshot(s.db, control) == before
            assert store_problems(s.db) == []
            after = s.note("After the storm", "An ordinary note, sent after every bad one.")
            assert (
                s.app.AsyncResult(enqueue(s.db, after, app=s.app)).get(timeout=60)["status"]
                == "indexed"
            )
            wait_for(lambda: two_pool_processes(s.worker), 30, "two pool processes")
            checked = len(cases) + 2
    finally:
        record("hostile input", faults=faults, checked=checked, lost=lost)


def snapshot(db: Any, item: int) -> list[tuple[Any, ...]]:
    return db.all(
        "SELECT c.id, c.chunk_index, c.start_offset, c.end_offset, c.content, e.vector, "
        "v.embedding FROM note_chunks c JOIN note_chunk_embeddings e ON e.chunk_id = c.id "
        "JOIN vec_chunk_embeddings v ON v.chunk_id = c.id WHERE c.item_id = ? "
        "ORDER BY c.chunk_index",
        (item,),
    )


def outcome(s: FaultStack, case: Case) -> str:
    """'ok', or what went wrong with this case."""
    if case.expect == "logged":
        wait_for(lambda: case.mark in s.worker.log, 30, f"the worker to log {case.name}")
        lines = [x for x in log_lines(s.worker.log) if case.mark in x["event"]]
        said = " ".join(json.dumps(x) for x in lines).lower()
        ran = s.db.scalar("SELECT count(*) FROM index_jobs WHERE task_id = ?", (case.task_id,))
        if ran or case.words not in said:
            return f"ran {ran} times; the log says: {said[:300]}"
        return "ok"
    result = s.app.AsyncResult(case.task_id)
    value = result.get(timeout=LONG, propagate=False)
    if case.expect == "refused":
        if result.state != "FAILURE" or case.words not in str(value):
            return f"{result.state}: {value!r}"[:300]
        return "ok"
    state = s.db.one(
        "SELECT status, last_error FROM item_index_state WHERE item_id = ?", (case.item,)
    )
    chunks = s.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (case.item,))
    if case.expect == "failed":
        if state is None or state[0] != "failed" or case.words not in (state[1] or ""):
            return f"state {state}"
        if result.state != "FAILURE" or case.words not in str(value):
            return f"{result.state}: {value!r}"[:300]
        return "ok" if chunks == 0 else f"{chunks} chunks written"
    if case.expect == "empty":  # nothing to index: a clear refusal, or indexed with no chunk
        refused = state and state[0] == "failed" and "empty" in (state[1] or "")
        nothing = state and state[0] == "indexed" and chunks == 0
        return "ok" if refused or nothing else f"state {state}, {chunks} chunks"
    assert case.text is not None
    if state is None or state[0] != "indexed" or result.state != "SUCCESS":
        return f"state {state}, task {result.state}: {value!r}"[:300]
    problems = slice_problems(s.db, case.item, case.text)
    return "ok" if problems == [] and chunks > 0 else f"{chunks} chunks: {problems}"


def test_hostile_an_item_id_beyond_64_bits_gets_the_one_line_failure(tmp_path):
    with fault_stack(tmp_path, workers=("hostile2",)) as s:
        result = s.app.send_task("GenerateEmbedding", args=[2**70])
        value = result.get(timeout=60, propagate=False)
        assert result.state == "FAILURE"
        assert re.fullmatch(rf"item {2**70}: .+ \(after \d+\.\d s\)", str(value)), repr(value)


# -- security -------------------------------------------------------------------------------


def test_security_pickle_refused_flower_closed_and_no_secret_in_any_log(tmp_path):
    faults, checked = 0, 0
    try:
        with fault_stack(tmp_path, workers=("secure1",)) as s:
            port = free_port()
            flower = start_flower(s.env, s.tmp, port)
            try:
                base = f"http://127.0.0.1:{port}"
                # A pickle message is refused by the worker, not loaded, not run.
                marker = tmp_path / "pickle-ran"
                item = s.note("Target of a pickle", "A note that a pickle message names.")
                pickled = send_pickle(
                    broker_url(FAULT_DB), "GenerateEmbedding", [item], {"reason": Opener(marker)}
                )
                faults += 1
                # Celery's line names no task id, but quotes the body (and so the marker's name).
                wait_for(lambda: marker.name in s.worker.log, 30, "the worker to see the message")
                said = [x for x in log_lines(s.worker.log) if marker.name in x["event"]]
                assert said and all(x["level"] in ("error", "warning", "critical") for x in said)
                assert "untrusted content of type pickle" in json.dumps(said)
                assert not marker.exists()
                assert (
                    s.db.scalar("SELECT count(*) FROM index_jobs WHERE task_id = ?", (pickled,))
                    == 0
                )
                assert s.state(item)["status"] == "pending"
                assert s.app.AsyncResult(pickled).state == "PENDING"  # nothing stored
                # Flower: closed without the credentials, everywhere.
                for method, path in (
                    ("GET", "/"),
                    ("GET", "/tasks"),
                    ("GET", "/api/tasks"),
                    ("GET", "/api/workers"),
                    ("GET", f"/api/task/info/{pickled}"),
                    ("POST", f"/api/task/revoke/{pickled}"),
                    ("POST", "/api/task/async-apply/GenerateEmbedding"),
                ):
                    for auth in (None, (FLOWER_USER, "wrong"), ("intruder", FLOWER_PASSWORD)):
                        r = httpx.request(method, base + path, auth=auth, timeout=5)
                        assert r.status_code == 401, (method, path, auth, r.status_code)
                        faults += 1
                ok = httpx.get(f"{base}/api/tasks", auth=(FLOWER_USER, FLOWER_PASSWORD), timeout=5)
                assert ok.status_code == 200
                # Flower got its credentials in its environment, not on its command line.
                cmdline = Path(f"/proc/{flower.popen.pid}/cmdline").read_bytes().decode()
                assert "flower" in cmdline and FLOWER_PASSWORD not in cmdline
                # Secrets that reach a log call are masked: the provider quotes the key back,
                # a client puts the password in a URL.
                s.standin.fail_status, s.standin.error_code = 401, API_KEY
                quoted = s.note("Quoted key", "The provider's refusal quotes the API key.")
                with pytest.raises(Exception, match="HTTP 401"):
                    s.app.AsyncResult(enqueue(s.db, quoted, app=s.app)).get(timeout=60)
                s.standin.reset()
                faults += 1
                r = httpx.get(f"{base}/api/tasks", params={"password": FLOWER_PASSWORD}, timeout=5)
                assert r.status_code == 401
                faults += 1
                worker_log, flower_log = s.worker.log, flower.log
                refusal = [
                    x
                    for x in log_lines(worker_log)
                    if x.get("item_id") == quoted and x["level"] == "error"
                ]
                assert refusal and "***" in json.dumps(refusal)  # it was there, and masked
                for name, log in (("worker", worker_log), ("flower", flower_log)):
                    assert API_KEY not in log, f"the API key is in the {name} log"
                    assert FLOWER_PASSWORD not in log, f"the Flower password is in the {name} log"
                checked = 2
            finally:
                flower.stop()
    finally:
        record("security", faults=faults, checked=checked)


def test_security_the_api_key_is_not_stored_in_errors(tmp_path):
    with fault_stack(tmp_path, workers=("secure2",)) as s:
        s.standin.fail_status, s.standin.error_code = 401, API_KEY
        item = s.note("Quoted key", "The provider's refusal quotes the API key.")
        result = s.app.AsyncResult(enqueue(s.db, item, app=s.app))
        with pytest.raises(Exception, match="HTTP 401"):
            result.get(timeout=60)
        stored = [
            str(result.result),
            s.db.scalar("SELECT last_error FROM item_index_state WHERE item_id = ?", (item,)),
            s.db.scalar("SELECT error FROM index_jobs WHERE task_id = ?", (result.id,)),
        ]
        assert all("HTTP 401" in x for x in stored)
        assert not [x for x in stored if API_KEY in x]
