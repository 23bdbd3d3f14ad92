"""The batch format shared by datamodules, training, calibration and callbacks: model inputs vs bookkeeping."""

from __future__ import annotations

from typing import Any, Mapping

import torch

META_KEYS: frozenset[str] = frozenset({"loss_mask", "skipped", "skipped_shards", "num_samples", "source_samples",
                                       "labels"})
"""Batch entries that are not keyword arguments of the model's forward: the loss mask (aligned with the
logits: true at t when token t+1 is a response token), skipped-sample counts, samples per weighted training
source, and labels (unused: the distillation loss uses the loss mask)."""


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch without `META_KEYS`: exactly the keyword arguments of the family's forward."""
    return {k: v for k, v in batch.items() if k not in META_KEYS}


def on_device(inputs: Mapping[str, Any], device: str | torch.device) -> dict[str, Any]:
    """`inputs` with every tensor moved to `device` (other entries as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
