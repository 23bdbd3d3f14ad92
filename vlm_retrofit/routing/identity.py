"""Invariant 1 as a user-facing check: freshly attached routers must leave the logits unchanged."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .adapter import attach_routers, get_adapter
from .config import RouterConfig


@torch.no_grad()
def check_identity(model: nn.Module, inputs: Mapping[str, Any], config: RouterConfig | None = None,
                   *, atol: float = 1e-4) -> float:
    """Attach fresh routers to `model`, compare logits with the base on `inputs`, detach, return the max diff
    (over the positions `inputs["attention_mask"]` marks real, when given).

    Raises AssertionError when the difference exceeds `atol` (fp32): the backbone's spec then routes the
    wrong tensors (see docs/backbones.md). The model is left exactly as it was given.
    """
    if get_adapter(model) is not None:
        raise RuntimeError("check_identity needs a model without routers; detach the existing adapter first")
    was_training = model.training
    model.eval()
    base = model(**inputs).logits.float()
    adapter = attach_routers(model, config, freeze_base=False)
    try:
        routed = model(**inputs).logits.float()
    finally:
        adapter.detach()
        model.train(was_training)
    difference = (routed - base).abs()
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == difference.shape[:2]:
        # Padding rows carry logits nothing reads; on real models with huge first-token activations their
        # fp32 noise alone can exceed the tolerance, so only real positions are compared.
        difference = difference[mask.bool()]
    diff = difference.max().item()
    if not diff <= atol:
        raise AssertionError(f"routers at init change the logits by {diff:.3g} (> {atol}): identity at init is broken")
    return diff
