"""A BERT encoder's forward pass in plain torch, for the local provider's BERT models
(all-MiniLM-L6-v2 is one): the tokenizer from `tokenizers`, the weights from safetensors.

Why not transformers' BertModel: importing it imports SciPy, SymPy, torch._dynamo and
torch.distributed, 150 MB of a worker process that inference never uses (measured: 218 MB after
`import torch`, 367 MB after `from transformers import BertModel`, bench/memory.py). The
computation is BERT's, in eval mode: embeddings (word + position + token type, LayerNorm), then
per layer self-attention and a GELU feed-forward, each with a residual and a LayerNorm. Its
output equals sentence-transformers' (tests/test_local_model.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F


class BertEncoder:
    """The last hidden states of a BERT model directory (config.json, model.safetensors)."""

    def __init__(self, path: Path) -> None:
        from safetensors.torch import load_file

        config = json.loads((path / "config.json").read_text())
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.hidden_size = int(config["hidden_size"])
        self.max_positions = int(config["max_position_embeddings"])
        weights = load_file(str(path / "model.safetensors"))
        self.w: dict[str, torch.Tensor] = {
            k.removeprefix("bert."): v.float() for k, v in weights.items()
        }
        missing = [k for k in self._needed() if k not in self.w]
        if missing:
            raise ValueError(f"{path}: not a BERT checkpoint (missing {missing[0]})")

    @staticmethod
    def supports(path: Path) -> bool:
        config = path / "config.json"
        if not config.is_file() or not (path / "model.safetensors").is_file():
            return False
        c = json.loads(config.read_text())
        return (
            c.get("model_type") == "bert"
            and c.get("hidden_act", "gelu") == "gelu"
            and c.get("position_embedding_type", "absolute") == "absolute"
        )

    def _needed(self) -> list[str]:
        names = [
            f"embeddings.{n}.weight"
            for n in (
                "word_embeddings",
                "position_embeddings",
                "token_type_embeddings",
                "LayerNorm",
            )
        ]
        names += [f"encoder.layer.{i}.output.LayerNorm.weight" for i in range(self.layers)]
        return names

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x, (self.hidden_size,), self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps
        )

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        w = self.w
        batch, length = input_ids.shape
        positions = torch.arange(length).unsqueeze(0)
        x = (
            F.embedding(input_ids, w["embeddings.word_embeddings.weight"])
            + F.embedding(positions, w["embeddings.position_embeddings.weight"])
            + F.embedding(token_type_ids, w["embeddings.token_type_embeddings.weight"])
        )
        x = self._norm(x, "embeddings.LayerNorm")
        head_size = self.hidden_size // self.heads
        keep = attention_mask[:, None, None, :].bool()  # padding is never attended to

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, head_size).transpose(1, 2)

        for i in range(self.layers):
            p = f"encoder.layer.{i}"
            q = split(self._linear(x, f"{p}.attention.self.query"))
            k = split(self._linear(x, f"{p}.attention.self.key"))
            v = split(self._linear(x, f"{p}.attention.self.value"))
            ctx = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, scale=1 / math.sqrt(head_size)
            )
            ctx = ctx.transpose(1, 2).reshape(batch, length, self.hidden_size)
            x = self._norm(
                self._linear(ctx, f"{p}.attention.output.dense") + x,
                f"{p}.attention.output.LayerNorm",
            )
            h = F.gelu(self._linear(x, f"{p}.intermediate.dense"))
            x = self._norm(self._linear(h, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
        return x


def load_tokenizer(path: Path, max_length: int | None) -> Any:
    """The model's fast tokenizer (tokenizer.json), truncating at `max_length` tokens with its
    special tokens (None: not at all, to count a text's tokens), padding a batch to its
    longest text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    if max_length is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_length=max_length)
    pad = tokenizer.padding or {}
    tokenizer.enable_padding(pad_id=pad.get("pad_id", 0), pad_token=pad.get("pad_token", "[PAD]"))
    return tokenizer
