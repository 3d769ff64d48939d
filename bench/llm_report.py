"""What LLM chunking does with one chapter: the chunks a scripted model's boundaries give, their
sizes, and one request body exactly as an OpenAI-compatible server would receive it (abridged).

    python bench/llm_report.py [CHAPTER]

The model is the stand-in's automatic one (testkit/standin_chat.py: consecutive units grouped to
about 900 characters), over real HTTP on 127.0.0.1; the embeddings are the stand-in's too.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.standin import StandIn  # noqa: E402
from worker.bulk import index_item  # noqa: E402
from worker.indexers import IndexOptions  # noqa: E402
from worker.providers import build_embedder  # noqa: E402
from worker.providers.chat import ChatModel  # noqa: E402
from worker.settings import ChunkSettings, EmbeddingSettings  # noqa: E402
from worker.store import connect  # noqa: E402
from worker.store.items import add_item  # noqa: E402

CORPUS = ROOT.parent / "shared" / "corpus" / "rustbook"


def abridged(body: dict, keep: int = 600) -> dict:
    out = json.loads(json.dumps(body))
    for message in out["messages"]:
        content = message["content"]
        if len(content) > keep:
            message["content"] = content[:keep] + f" …[{len(content) - keep} more characters]"
    schema = out.get("response_format", {}).get("json_schema", {})
    if "schema" in schema:
        schema["schema"] = "…(the JSON schema of {chunks: [{start, end, summary}]})"
    return out


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "ch04-01-what-is-ownership.md"
    text = (CORPUS / name).read_text(encoding="utf-8")
    with StandIn(dimensions=64) as standin, tempfile.TemporaryDirectory() as tmp:
        emb = EmbeddingSettings(
            provider="openai", model="standin-embed", base_url=standin.base_url, dimensions=64
        )
        db = connect(Path(tmp) / "r.db", embedding=emb)
        chat = ChatModel(ChunkSettings(model="standin-chat", base_url=standin.base_url))
        item = add_item(db, kind="note", title=name, content=text)
        result = index_item(
            db, item, embedder=build_embedder(emb, dimensions=64), options=IndexOptions(chat=chat)
        )
        rows = db.all(
            "SELECT chunk_index, method, length(content), summary FROM note_chunks "
            "WHERE item_id = ? ORDER BY chunk_index",
            (item,),
        )
        print(
            f"{name}: {len(text)} characters, {standin.chat.requests} chat requests "
            f"(windows), {result.chunks} chunks, method {result.chunk_method}"
        )
        sizes = [r[2] for r in rows]
        print(f"sizes: min {min(sizes)}, median {statistics.median(sizes):.0f}, max {max(sizes)}")
        print(f"{'#':>3} {'method':<9} {'chars':>5}  summary")
        for index, method, length, summary in rows:
            print(f"{index:>3} {method:<9} {length:>5}  {(summary or '')[:70]}")
        print("\nThe first request, as sent (abridged):")
        print(json.dumps(abridged(standin.chat.bodies[0]), indent=2, ensure_ascii=False))
        db.close()


if __name__ == "__main__":
    main()
