"""LlamaIndex's IngestionPipeline over two versions of a corpus, for bench/incremental.py.

    python bench/peers/llamaindex_incremental.py --before DIR --after DIR --base-url URL
        --work DIR [--batch-size B] [--dimensions D]

IngestionPipeline([SentenceSplitter, OpenAIEmbedding]) with a SimpleDocumentStore docstore
and the upserts strategy (which needs a vector store to delete from: SimpleVectorStore).
SentenceSplitter(chunk_size=1500, chunk_overlap=100) counted in characters (tokenizer=list),
the sizes LangChain's splitter is given, or with `--splitter default` SentenceSplitter() as it
comes (1024 tokens of cl100k_base, 200 overlapping; LlamaIndex ships that encoding, so nothing is
downloaded); OpenAIEmbedding at the stand-in with
embed_batch_size = the batch size. Documents keep their file name as id, so that the second
run finds them.

Phases: `setup`, `full` (every file of `before/`), then the edit: the changed files of
`after/` run through the same pipeline.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.corpus_pair import read_pair, source_of
from bench.peers.harness import API_KEY, MODEL, done, phase


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dimensions", type=int, default=384)
    ap.add_argument("--splitter", choices=("chars", "default"), default="chars")
    args = ap.parse_args()

    from llama_index.core import Document
    from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.storage.docstore import SimpleDocumentStore
    from llama_index.core.vector_stores import SimpleVectorStore
    from llama_index.embeddings.openai import OpenAIEmbedding

    old, new, changed = read_pair(args.before, args.after)
    embed = OpenAIEmbedding(
        model_name=MODEL,
        api_base=args.base_url,
        api_key=API_KEY,
        dimensions=args.dimensions,
        embed_batch_size=args.batch_size,
        max_retries=0,
    )
    if args.splitter == "chars":
        splitter = SentenceSplitter(chunk_size=1500, chunk_overlap=100, tokenizer=list)
    else:
        splitter = SentenceSplitter()
    pipeline = IngestionPipeline(
        transformations=[splitter, embed],
        docstore=SimpleDocumentStore(),
        vector_store=SimpleVectorStore(),
        docstore_strategy=DocstoreStrategy.UPSERTS,
    )

    def docs(texts: dict[str, str], names: list[str]) -> list[Document]:
        return [
            Document(text=texts[n], id_=source_of(n), metadata={"source": source_of(n)})
            for n in names
        ]

    phase("setup", files=len(old), changed=len(changed))

    t0 = time.perf_counter()
    nodes = pipeline.run(documents=docs(old, list(old)))
    phase("full", seconds=time.perf_counter() - t0, chunks=len(nodes))

    t0 = time.perf_counter()
    nodes = pipeline.run(documents=docs(new, changed))
    seconds = time.perf_counter() - t0
    done(
        seconds=seconds,
        documents=len(changed),
        chunks=len(nodes),
        docstore_documents=len(pipeline.docstore.docs),
    )


if __name__ == "__main__":
    main()
