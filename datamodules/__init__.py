"""Streaming image-text data for distillation: WebDataset data module, formatting, skip counting, shard builder."""

from vlm_retrofit.batch import META_KEYS, model_inputs

from .formatting import ChatFormatter, Example, load_processor
from .quality import (
    REASONS,
    DataQualityCallback,
    DataQualityError,
    DataQualityTracker,
    SkipCounter,
    check_bad_fraction,
)
from .shards import build_shards, write_tar
from .synthetic import ensure_synthetic_shards, write_synthetic_shards
from .webdataset import ShardError, WebDatasetDataModule, manifest_urls, resolve_shards

__all__ = [
    "META_KEYS",
    "REASONS",
    "ChatFormatter",
    "DataQualityCallback",
    "DataQualityError",
    "DataQualityTracker",
    "Example",
    "ShardError",
    "SkipCounter",
    "WebDatasetDataModule",
    "build_shards",
    "check_bad_fraction",
    "ensure_synthetic_shards",
    "load_processor",
    "manifest_urls",
    "model_inputs",
    "resolve_shards",
    "write_synthetic_shards",
    "write_tar",
]
