"""LangChain's incremental indexing over two versions of a corpus, for bench/incremental.py.

    python bench/peers/langchain_incremental.py --before DIR --after DIR --base-url URL
        --work DIR [--batch-size B] [--dimensions D]

`index(docs, record_manager, vector_store, cleanup="incremental", source_id_key="source")`
with a SQLRecordManager (SQLite file) over InMemoryVectorStore, which implements delete.
SQLiteVec does not: the setup phase tries it and reports LangChain's answer. Documents are
split by RecursiveCharacterTextSplitter(1500, 100); OpenAIEmbeddings at the stand-in with
chunk_size = the batch size, and index()'s batch_size the same.

Phases: `setup`, `full` (every file of `before/`), then the edit: the changed files of
`after/`, split and given to index() (the unchanged chunks are skipped by their hash; the
changed file's chunks that are gone are deleted, as cleanup="incremental" does).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.corpus_pair import read_pair, source_of
from bench.peers.harness import API_KEY, MODEL, done, phase


def sqlitevec_answer(embeddings: object, work: Path) -> dict[str, object]:
    """Whether SQLiteVec implements delete, and what index() says when cleanup needs it."""
    import sqlite_vec
    from langchain_classic.indexes import SQLRecordManager
    from langchain_community.vectorstores import SQLiteVec
    from langchain_core.documents import Document
    from langchain_core.indexing import index
    from langchain_core.vectorstores import VectorStore
    from pysqlite3 import dbapi2 as sqlite3

    conn = sqlite3.connect(str(work / "sqlitevec.db"))
    conn.row_factory = sqlite3.Row
    conn.enable_load_extension(True)
    sqlite_vec.load(conn)
    conn.enable_load_extension(False)
    store = SQLiteVec(table="chunks", connection=conn, embedding=embeddings)  # type: ignore[arg-type]
    manager = SQLRecordManager("sqlitevec", db_url=f"sqlite:///{work / 'sqlitevec-records.db'}")
    manager.create_schema()
    answer: dict[str, object] = {"implements_delete": type(store).delete is not VectorStore.delete}
    try:
        index(
            [Document(page_content="x", metadata={"source": "x"})],
            manager,
            store,
            cleanup="incremental",
            source_id_key="source",
        )
        answer["index_incremental"] = "accepted"
    except Exception as e:  # what LangChain answers is the finding
        answer["index_incremental"] = f"{type(e).__name__}: {e}"
    conn.close()
    return answer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dimensions", type=int, default=384)
    args = ap.parse_args()

    from langchain_classic.indexes import SQLRecordManager
    from langchain_core.indexing import index
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import OpenAIEmbeddings
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    old, new, changed = read_pair(args.before, args.after)
    splitter = RecursiveCharacterTextSplitter(chunk_size=1500, chunk_overlap=100)
    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=args.base_url,
        api_key=API_KEY,
        dimensions=args.dimensions,
        chunk_size=args.batch_size,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    sqlitevec = sqlitevec_answer(embeddings, args.work)
    store = InMemoryVectorStore(embeddings)
    manager = SQLRecordManager("kidx-bench", db_url=f"sqlite:///{args.work / 'records.db'}")
    manager.create_schema()

    def docs(texts: dict[str, str], names: list[str]) -> list:
        return splitter.create_documents(
            [texts[n] for n in names], metadatas=[{"source": source_of(n)} for n in names]
        )

    def run(texts: dict[str, str], names: list[str]) -> dict:
        return dict(
            index(
                docs(texts, names),
                manager,
                store,
                cleanup="incremental",
                source_id_key="source",
                batch_size=args.batch_size,
            )
        )

    phase("setup", files=len(old), changed=len(changed), sqlitevec=sqlitevec)

    t0 = time.perf_counter()
    full = run(old, list(old))
    phase("full", seconds=time.perf_counter() - t0, chunks=full["num_added"], index=full)

    t0 = time.perf_counter()
    result = run(new, changed)
    seconds = time.perf_counter() - t0
    done(seconds=seconds, documents=len(changed), index=result, chunks=len(docs(new, changed)))


if __name__ == "__main__":
    main()
