"""LangChain's in-process pipeline over a corpus, for bench/throughput.py (its own process).

    python bench/peers/langchain_throughput.py --corpus DIR --base-url URL --db PATH
        [--batch-size B] [--dimensions D] [--chunk-size N]

RecursiveCharacterTextSplitter(1500, 100) (`--chunk-size`: another size, overlap 100),
OpenAIEmbeddings pointed at the stand-in (chunk_size = the batch size, raw texts: no
tiktoken, which would download its encoding), and SQLiteVec.add_documents into a fresh file.
Python's sqlite3 here cannot load extensions, so the connection is pysqlite3's (a SQLite built
with loading enabled), handed to SQLiteVec.

Phases: `setup` (files read, objects built; SQLiteVec has already embedded one dummy text to
learn the dimension), `run` (timed: split every file, embed and write every chunk), then the
count of rows written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.harness import API_KEY, MODEL, done, phase


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--db", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dimensions", type=int, default=384)
    ap.add_argument("--chunk-size", type=int, default=1500)
    args = ap.parse_args()

    import sqlite_vec
    from langchain_community.vectorstores import SQLiteVec
    from langchain_openai import OpenAIEmbeddings
    from langchain_text_splitters import RecursiveCharacterTextSplitter
    from pysqlite3 import dbapi2 as sqlite3

    files = sorted(p for p in args.corpus.glob("*.md") if p.read_text(encoding="utf-8").strip())
    texts = [p.read_text(encoding="utf-8") for p in files]
    metadatas = [{"source": str(p.resolve())} for p in files]
    splitter = RecursiveCharacterTextSplitter(chunk_size=args.chunk_size, chunk_overlap=100)
    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=args.base_url,
        api_key=API_KEY,
        dimensions=args.dimensions,
        chunk_size=args.batch_size,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    conn = sqlite3.connect(str(args.db))
    conn.row_factory = sqlite3.Row
    conn.enable_load_extension(True)
    sqlite_vec.load(conn)
    conn.enable_load_extension(False)
    store = SQLiteVec(table="chunks", connection=conn, embedding=embeddings)
    phase("setup", files=len(files), sqlite=sqlite3.sqlite_version)

    t0, cpu0 = time.perf_counter(), time.process_time()
    docs = splitter.create_documents(texts, metadatas=metadatas)
    store.add_documents(docs)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    phase("run", seconds=seconds, cpu_seconds=cpu, chunks=len(docs))  # the driver's meter stops
    rows = conn.execute("SELECT count(*) FROM chunks_vec").fetchone()[0]
    conn.close()
    done(vec_rows=rows)


if __name__ == "__main__":
    main()
