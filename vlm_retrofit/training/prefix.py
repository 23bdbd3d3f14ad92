"""Sharing the teacher's forward of the decoder layers below the first adapted or removed one with the student."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import Tensor, nn

from ..backbones import layer_hidden_states, with_layer_hidden_states


@contextlib.contextmanager
def layer_input_captured(layer: nn.Module, store: dict[str, Tensor]) -> Iterator[None]:
    """Within the context, every call of `layer` writes the hidden states it receives to `store["hidden"]`."""
    def capture(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        store["hidden"] = layer_hidden_states(args, kwargs)

    handle = layer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def layer_input_replaced(layer: nn.Module, hidden: Tensor) -> Iterator[None]:
    """Within the context, `layer` receives `hidden` in place of the hidden states its caller passes."""
    def replace(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        return with_layer_hidden_states(args, kwargs, hidden)

    handle = layer.register_forward_pre_hook(replace, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def first_adapted_layer(layers: nn.ModuleList, model: nn.Module, adapter_modules: list[nn.Module]) -> int:
    """Index of the first decoder layer where the student may compute something the teacher does not: one holding
    a parameter that requires grad or one of `adapter_modules` (a LoRA is on in the student, off in the teacher,
    trained or not); `len(layers)` when none does. 0 when such a parameter or module lies outside the decoder
    layers (an embedding, the vision side or the projector may act below every layer)."""
    in_layer = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    in_layer.update({id(m): i for i, layer in enumerate(layers) for m in layer.modules()})
    indices = [in_layer.get(id(p), -1) for p in model.parameters() if p.requires_grad]
    indices += [in_layer.get(id(m), -1) for m in adapter_modules]
    if any(i < 0 for i in indices):
        return 0
    return min(indices, default=len(layers))
