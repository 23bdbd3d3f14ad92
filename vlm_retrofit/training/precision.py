"""Mixed precision around PEFT's LoRA layers: no fp32 copies of their inputs where autocast recasts them anyway."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """PEFT tuner layers of `model` (empty without peft or without a LoRA)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # peft is optional for router-only training
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def autocast_lora_inputs(layers: list[nn.Module], device_type: str) -> Iterator[None]:
    """Under autocast, let LoRA layers take their input as it comes.

    PEFT casts each LoRA input to its weights' dtype (fp32 here: the frozen base is bf16, the LoRA trains in
    fp32), and autocast then casts it back to bf16 for the matmul: two copies of the activations per adapted
    projection, forward and backward, for the same numbers. Outside autocast the cast is needed (a bf16 input
    and fp32 weights cannot multiply) and is left on. `peft.helpers.disable_input_dtype_casting` does the same
    for a whole model but walks its every module (thousands) on each call; `layers` is listed once. The flags are
    per layer: a forward of the same model in another thread, outside autocast, would see them off.
    """
    if not layers or not torch.is_autocast_enabled(device_type):
        yield
        return
    saved = [getattr(layer, "cast_input_dtype_enabled", True) for layer in layers]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for layer, value in zip(layers, saved):
            layer.cast_input_dtype_enabled = value
