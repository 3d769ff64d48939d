"""Celery's soft time limit reaches the task through the engine: billiard raises
SoftTimeLimitExceeded (an Exception subclass) from a signal handler in the pool process, in
whatever code runs then. The engine's `except Exception` fallbacks swallowed it: the run went
on towards the hard kill and ended `indexed`. A real prefork worker with a short soft limit, the
stand-in's chat model answering too late."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator

import pytest

from stack import (
    SPARE_DB,
    Stack,
    broker_url,
    flush,
    queue_env,
    running_stack,
    start_worker,
    wait_for,
)
from tasks.producer import enqueue_note

pytestmark = [pytest.mark.stack]

SOFT_LIMIT = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    def make(tmp, standin) -> Stack:
        env = {
            "KIDX_TASKS__SOFT_TIME_LIMIT": str(SOFT_LIMIT),
            "KIDX_TASKS__TIME_LIMIT": "60",
            "KIDX_CHUNK__MODEL": "standin-chat",
            "KIDX_CHUNK__BASE_URL": standin.base_url,
            "KIDX_CHUNK__TIMEOUT": "120",
            "KIDX_CHUNK__MAX_RETRIES": "0",
            # past the soft limit, as an operator may set it: the limit comes first
            "KIDX_CHUNK__DEADLINE": "600",
        }
        return Stack(tmp, standin, env=env)

    with running_stack(tmp_path_factory.mktemp("soft"), make) as s:
        yield s


def test_the_soft_time_limit_during_llm_chunking_fails_the_run_not_falls_back(stack):
    """The limit passes while the chunk model thinks: the task fails with the limit as its
    reason; it does not fall back to structural chunks and end `indexed`."""
    stack.standin.chat.delay = 600  # far past the limit (a stop of the stand-in wakes it)
    item = stack.note("Slow chunking", "A note to chunk with the model. " * 30)
    result = stack.app.AsyncResult(enqueue_note(stack.db, item, app=stack.app))
    with pytest.raises(Exception, match="soft time limit") as failure:
        result.get(timeout=60)
    assert type(failure.value).__name__ == "IndexFailed"
    assert stack.standin.chat.requests == 1  # the limit came during the chat call
    state = wait_for(
        lambda: (s := stack.state(item))["status"] == "failed" and s, 30, "the item failed"
    )
    # the item's own error names the limit (the engine saw an exception it does not know)
    assert state["last_error"] == f"ran over the soft time limit of {SOFT_LIMIT} s", state
    job = stack.db.scalar("SELECT error FROM index_jobs WHERE task_id = ?", (result.id,))
    assert f"ran over the soft time limit of {SOFT_LIMIT} s" in job  # the task's
    assert stack.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)) == 0


def test_llm_chunking_past_its_deadline_falls_back_in_a_worker_before_the_limit(stack, tmp_path):
    """A worker whose chunk deadline comes before its soft time limit: the same held answer
    ends in structural chunks, the item indexed, the deadline named as the reason."""
    env = {
        "KIDX_TASKS__SOFT_TIME_LIMIT": "30",
        "KIDX_TASKS__TIME_LIMIT": "60",
        "KIDX_CHUNK__MODEL": "standin-chat",
        "KIDX_CHUNK__BASE_URL": stack.standin.base_url,
        "KIDX_CHUNK__TIMEOUT": "120",
        "KIDX_CHUNK__MAX_RETRIES": "0",
        "KIDX_CHUNK__DEADLINE": "1",
    }
    flush(SPARE_DB)
    beside = Stack(tmp_path, stack.standin, worker="deadline", env=env, redis_db=SPARE_DB)
    stack.standin.chat.delay = 600
    try:
        item = beside.note("Slow chunking", "A note to chunk with the model. " * 30)
        chats = stack.standin.chat.requests
        result = beside.app.AsyncResult(enqueue_note(beside.db, item, app=beside.app))
        assert result.get(timeout=30)["status"] == "indexed"
        state = beside.state(item)
        assert state["chunk_method"] == "structure"
        assert "KIDX_CHUNK__DEADLINE" in state["last_error"], state
        assert stack.standin.chat.requests == chats + 1
    finally:
        stack.standin.chat.delay = 0
        beside.close()
        flush(SPARE_DB)


@pytest.mark.model
def test_the_soft_time_limit_while_the_local_model_embeds_memories_fails_the_task(tmp_path):
    """The local model ran `kidx.embed_memories` on the task's own thread and turned the
    limit into a PermanentProviderError: the task returned as if the provider had refused.
    The limit now ends the task failed with it, and nothing half-written stays."""
    from worker.app import EMBED_MEMORIES, create_app
    from worker.settings import load_settings
    from worker.store import connect

    local = {"provider": "local", "model": "all-MiniLM-L6-v2", "dimensions": 384}
    broker = broker_url(SPARE_DB)  # beside the module's stack, whose worker would take the task
    settings = load_settings(db=tmp_path / "kidx.db", broker_url=broker, embedding=local)
    db = connect(settings.db, embedding=settings.embedding)
    memories = [(f"memory number {i}: " + "some words about it " * 12,) for i in range(512)]
    db.executemany("INSERT INTO memories(content) VALUES (?)", memories)  # as a host does
    env = queue_env(
        tmp_path,
        "http://127.0.0.1:9/v1",  # not used: the model is local
        KIDX_BROKER_URL=broker,
        KIDX_EMBEDDING__PROVIDER="local",
        KIDX_EMBEDDING__MODEL="all-MiniLM-L6-v2",
        KIDX_EMBEDDING__DIMENSIONS="384",
        KIDX_EMBEDDING__BATCH_SIZE="512",
        KIDX_TASKS__SOFT_TIME_LIMIT=str(SOFT_LIMIT),
        KIDX_TASKS__TIME_LIMIT="60",
    )
    app = create_app(settings)
    flush(SPARE_DB)
    worker = start_worker(env, tmp_path, app, name="softlocal", concurrency=1)
    try:
        result = app.send_task(EMBED_MEMORIES)
        with pytest.raises(Exception) as failure:
            result.get(timeout=120)
        assert type(failure.value).__name__ == "SoftTimeLimitExceeded", failure.value
        assert db.scalar("SELECT count(*) FROM memory_embeddings") == 0  # one batch: none
    finally:
        worker.stop()
        db.close()
        flush(SPARE_DB)


@pytest.mark.parametrize("kind", ["pdf", "docx"])
def test_the_soft_time_limit_inside_a_pdf_or_docx_parser_is_not_an_unreadable_file(
    kind, monkeypatch
):
    """The converters refuse a damaged file whatever pypdf or python-docx raise; the limit
    (raised by billiard's signal handler in whatever code runs, here the parser's) was
    refused as an 'unreadable' file too. Only the parsers' own errors and Python's are
    refusals now; the limit propagates, and a damaged file is still refused."""
    import docx
    import pypdf
    from billiard.exceptions import SoftTimeLimitExceeded

    from worker.errors import InvalidInput
    from worker.sources.docx import docx_to_markdown
    from worker.sources.pdf import pdf_text

    def convert(data: bytes) -> str:
        if kind == "pdf":
            return pdf_text(data, "a.pdf", limit=10_000)
        return docx_to_markdown(data, "a.docx", limit=10_000, max_xml=10_000_000)

    with pytest.raises(InvalidInput, match=f"unreadable {kind.upper()}"):
        convert(b"PK\x03\x04 damaged" if kind == "docx" else b"%PDF-1.4 damaged")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise SoftTimeLimitExceeded()  # as the signal handler does where the parser is

    if kind == "pdf":
        monkeypatch.setattr(pypdf, "PdfReader", interrupted)
    else:
        monkeypatch.setattr(docx, "Document", interrupted)
    archive = io.BytesIO()  # a sound zip, for the unpacked-size check before the parser
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("word/document.xml", "<w:document/>")
    with pytest.raises(SoftTimeLimitExceeded):
        convert(b"%PDF-1.4 damaged" if kind == "pdf" else archive.getvalue())
