"""The local provider: all-MiniLM-L6-v2 through transformers, with the pooling and normalisation
of its sentence-transformers configuration; compared with sentence-transformers itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import corpus_text
from worker.chunking import chunk_structure
from worker.errors import ConfigError
from worker.providers.local import encode, load_model, model_path, read_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.model
def test_vectors_equal_sentence_transformers_own_in_the_texts_order():
    from sentence_transformers import SentenceTransformer

    chunks = [
        c.embedding_input("Traits") for c in chunk_structure(corpus_text("ch10-02-traits.md"))
    ]
    texts = ["", "short", "é ü ß 中文", *chunks[:9], "word " * 900]  # 900 words: truncated
    ours = encode(load_model("all-MiniLM-L6-v2"), texts)
    reference = SentenceTransformer(str(model_path("all-MiniLM-L6-v2")), device="cpu").encode(
        texts, normalize_embeddings=False, convert_to_numpy=True
    )
    assert ours.shape == (len(texts), 384) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # Normalize
    one_by_one = np.stack([encode(load_model("all-MiniLM-L6-v2"), [t])[0] for t in texts[:5]])
    np.testing.assert_allclose(ours[:5], one_by_one, atol=2e-5)  # padding changes nothing


@pytest.mark.model
def test_the_bundled_model_imports_neither_sentence_transformers_nor_transformers():
    code = (
        "import sys, json\n"
        "from worker.providers import build_embedder\n"
        "from worker.settings import EmbeddingSettings\n"
        "m = build_embedder(EmbeddingSettings(provider='local'), dimensions=384)\n"
        "v = m.embed_checked(['one text', 'another'])\n"
        "print(json.dumps([v.shape[1]] + [n in sys.modules for n in "
        "('sentence_transformers', 'sklearn', 'transformers', 'scipy')]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [384, False, False, False, False]


def _model_dir(tmp_path: Path, modules: list[dict], pooling: dict | None = None) -> Path:
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


ST = "sentence_transformers.models."


def test_the_configuration_names_pooling_and_normalisation(tmp_path):
    d = _model_dir(
        tmp_path,
        [{"type": ST + "Transformer", "path": ""}, {"type": ST + "Pooling", "path": "1_Pooling"}],
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
    )
    (d / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    assert read_config(d) == ("cls", False, 128)
    assert read_config(model_path("all-MiniLM-L6-v2")) == ("mean", True, 256)
    assert read_config(tmp_path / "nowhere") == ("mean", False, None)  # plain transformers


@pytest.mark.parametrize(
    ("modules", "pooling", "why"),
    [
        ([{"type": ST + "Dense", "path": "2_Dense"}], None, "Dense is not supported"),
        (
            [{"type": ST + "Pooling", "path": "1_Pooling"}],
            {"pooling_mode_weightedmean_tokens": True},
            "pooling",
        ),
        (
            [{"type": ST + "Pooling", "path": "1_Pooling"}],
            {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
            "pooling",
        ),
    ],
)
def test_a_model_it_cannot_reproduce_is_refused_by_name(tmp_path, modules, pooling, why):
    with pytest.raises(ConfigError, match=why):
        read_config(_model_dir(tmp_path, modules, pooling))


def test_an_unknown_model_name_is_a_clear_error():
    with pytest.raises(ConfigError, match="neither the bundled"):
        model_path("some/hub-model")


@pytest.mark.model
def test_texts_longer_than_the_model_reads_are_said_in_the_log(monkeypatch):
    """Chunks are sized in characters: 1,500 of code or of Chinese are more than its 256
    tokens, and were cut with nothing said. Said at the 1st, 10th, 100th cut text."""
    import structlog

    from worker.providers.local import LocalEmbeddings
    from worker.settings import EmbeddingSettings

    model = load_model("all-MiniLM-L6-v2")
    monkeypatch.setattr(model, "cut", 0)
    local = LocalEmbeddings(
        EmbeddingSettings(provider="local", model="all-MiniLM-L6-v2"), dimensions=384
    )
    long = "中文字符 " * 200  # 1,000 characters, about 600 tokens
    with structlog.testing.capture_logs() as logs:
        local.embed_batch(["short", "a few more words", long])
        local.embed_batch([long] * 8)  # 9 so far: nothing more said
        local.embed_batch([long, "short"])  # the 10th
        local.embed_batch(["short"] * 3)
    said = [e for e in logs if "filled what the local model reads" in e["event"]]
    assert [e["cut_so_far"] for e in said] == [1, 10]
    assert said[0]["reads_at_most"] == model.max_tokens == 256


@pytest.mark.model
def test_a_lone_surrogate_in_a_query_is_the_querys_fault_not_the_models(tmp_path):
    """The tokenizer's TypeError was a PermanentProviderError, "all-MiniLM-L6-v2 (local)"."""
    from worker.errors import InvalidInput
    from worker.indexers.memories import search_memories
    from worker.providers.local import LocalEmbeddings
    from worker.retrieval import search_chunks
    from worker.settings import EmbeddingSettings
    from worker.store import connect

    settings = EmbeddingSettings(provider="local", model="all-MiniLM-L6-v2")
    db = connect(tmp_path / "kidx.db", embedding=settings)
    local = LocalEmbeddings(settings, dimensions=384)
    try:
        for search in (search_chunks, search_memories):
            with pytest.raises(InvalidInput, match=r"lone surrogate U\+D800 at character 1"):
                search(db, "a\ud800", local)
    finally:
        db.close()


@pytest.mark.model
def test_a_memory_the_model_reads_nothing_of_is_refused_added_or_written_by_a_host(tmp_path):
    """NUL, a zero-width space, a BOM: the model read its markers alone, and such memories
    came first for any query of punctuation, above every real one."""
    from worker.errors import InvalidInput
    from worker.indexers.memories import add_memory, embed_memories, search_memories
    from worker.providers.local import LocalEmbeddings
    from worker.settings import EmbeddingSettings
    from worker.store import connect

    settings = EmbeddingSettings(provider="local", model="all-MiniLM-L6-v2")
    db = connect(tmp_path / "kidx.db", embedding=settings)
    local = LocalEmbeddings(settings, dimensions=384)
    try:
        for text in ("\x00", "\u200b", "\ufeff"):
            with pytest.raises(InvalidInput, match="holds nothing all-MiniLM-L6-v2 reads"):
                add_memory(db, text, local)
        tea = add_memory(db, "Tea, no milk.", local)
        db.execute("INSERT INTO memories(content) VALUES (?)", ("\u200b\u200b",))  # a host's
        report = embed_memories(db, local)
        assert report.embedded == 0 and report.too_long == 1
        hits, _, _ = search_memories(db, "!!!?!...", local, k=5)
        assert [h.memory_id for h in hits] == [tea]
    finally:
        db.close()
