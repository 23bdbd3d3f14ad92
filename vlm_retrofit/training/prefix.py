"""Forward pre-hooks of a training step: the teacher's forward of the decoder layers below the first adapted or
removed one shared with the student, and the LM head run only at the positions the loss reads."""

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


@contextlib.contextmanager
def head_rows_selected(lm_head: nn.Module, rows: Tensor) -> Iterator[None]:
    """Within the context, `lm_head` receives only the hidden states at the positions where `rows` (bool [B, T], as
    the hidden states it is called on) is True, flattened: the model returns logits [N, V], N = `rows.sum()`.

    HF's `logits_to_keep` selects whole columns, so a batch of one long and three short rows computes, keeps and
    backpropagates logits for every padded or unscored position of the columns the long row trains on (and indexing
    them out costs a full-size zero-filled gradient in backward). Whatever the model does to the logits after its
    head (Gemma's soft-capping) is per element, so it sees the rows as it would have seen them in place.
    """
    def select(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        if hidden.shape[:2] != rows.shape:
            raise RuntimeError(f"head_rows_selected: the LM head got hidden states {tuple(hidden.shape)} for a row "
                               f"mask {tuple(rows.shape)}; pass the model no logits_to_keep")
        return (hidden[rows], *args[1:])

    handle = lm_head.register_forward_pre_hook(select)
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
