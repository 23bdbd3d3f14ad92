"""PEFT's adapter layers listed once per model, and switches over that list (the teacher's LoRA off; no fp32 input
copies under autocast) that PEFT's own helpers make by walking every module of the backbone on each call."""

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


def adapter_switches(model: nn.Module) -> list[nn.Module]:
    """What PEFT's `disable_adapter()` switches off: its tuner layers (LoRA, trainable tokens) and the wrappers of
    `modules_to_save` (empty without peft or without an adapter)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module, switches: list[nn.Module]) -> Iterator[None]:
    """The PEFT `model` with its adapters off, as `model.disable_adapter()` has it for LoRA: every layer of
    `switches` (`adapter_switches(model)`) runs its base module alone, and the model reports its adapters disabled.

    PEFT's context reads the model's adapter status first and then switches the layers it finds, walking all the
    backbone's modules several times per call: ~0.12 s on a 30-layer backbone whatever its width, a quarter of a
    training step wherever steps are bound by the host (a GPU's), once per step for the teacher. Here each layer
    gets the flag PEFT's `enable_adapters(False)` sets, and gets its own value back after; requires_grad is left
    alone (the teacher runs without autograd). A PEFT whose layers lack that flag gets its own context."""
    if not switches:
        yield
        return
    if not all(hasattr(layer, "_disable_adapters") for layer in switches):
        with model.disable_adapter():
            yield
        return
    with _set_on_each(switches, "_disable_adapters", True):
        if "_adapters_disabled" not in model.__dict__:  # not a PeftModel (a tuner model alone)
            yield
            return
        with _set_on_each([model], "_adapters_disabled", True):
            yield


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
    with _set_on_each(layers, "cast_input_dtype_enabled", False, missing=True):
        yield


@contextlib.contextmanager
def _set_on_each(objects: list[object], name: str, value: object, *, missing: object = None) -> Iterator[None]:
    """Attribute `name` = `value` on each of `objects` within the context, then each one's own value back (`missing`
    stands for an absent attribute)."""
    saved = [getattr(obj, name, missing) for obj in objects]
    for obj in objects:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, before in zip(objects, saved):
            setattr(obj, name, before)
