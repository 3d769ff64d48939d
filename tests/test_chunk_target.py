"""The structural chunker's target as a setting (`KIDX_CHUNK__TARGET`)."""

from __future__ import annotations

from worker.chunking.base import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, TARGET_CHUNK_SIZE
from worker.settings import ChunkSettings


def test_the_setting_s_default_and_bounds_are_the_chunker_s():
    """Written out in worker/settings.py (importing the chunking package there is circular)."""
    field = ChunkSettings.model_fields["target"]
    bounds = {type(m).__name__: m for m in field.metadata}
    assert field.default == TARGET_CHUNK_SIZE
    assert bounds["Ge"].ge == MIN_CHUNK_SIZE and bounds["Le"].le == MAX_CHUNK_SIZE
