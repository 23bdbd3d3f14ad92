"""Layer replacement of removed layers: the layer in front of each removed span, retrained to do the span's work too.

When layers p+1..b are removed, layer p is given new weights, trained so that from its own input it writes what the
full model's layers p..b wrote together (`fit_layer_replacements`: the full model's stream after layer b as the
target, a per-token relative squared error on the update, only that one layer's forward and backward per step).
A pruned release then holds layer p with those weights and none of p+1..b: an ordinary model of the same family,
one layer per span more than plain removal keeps, so its compute is that of removing b - p layers. It is the
nonlinear counterpart of the linear replacement (`vlm_retrofit.replacement`; LLM-Streamline, Chen et al. 2024, trains
a lightweight network for a pruned span the same way). A replacement is kept as the layer's state dict (the names
of the plain layer, no adapter wrappers), keyed by p like a linear one.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Iterable, Iterator, Literal, Mapping

import torch
from torch import Tensor, nn

from .backbones.registry import BackboneSpec, layer_hidden_states, layer_output, unwrap_model
from .routing import entry


def standalone_layer(layer: nn.Module) -> nn.Module:
    """A copy of decoder `layer` with nothing of the framework or PEFT on it: no hooks or patched forward (the
    routers' and a skip context's), LoRA and `modules_to_save` wrappers replaced by the modules they wrap."""
    clone = copy.deepcopy(layer)
    for module in list(clone.modules()):
        module.__dict__.pop("forward", None)
        entry.remove(module)
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      module._backward_pre_hooks, module._forward_hooks_with_kwargs, module._forward_pre_hooks_with_kwargs):
            hooks.clear()
        for name, child in list(module.named_children()):
            if _wrapped(child) is not child:
                setattr(module, name, _wrapped(child))
    return clone


def _wrapped(module: nn.Module) -> nn.Module:
    """The module a PEFT wrapper stands for (a LoRA layer's base layer, a `modules_to_save` wrapper's original);
    `module` itself when it wraps nothing."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    if isinstance(module, BaseTunerLayer):
        return module.get_base_layer()
    if isinstance(module, ModulesToSaveWrapper):
        return module.original_module
    return module


def standalone_shapes(layer: nn.Module) -> dict[str, tuple[int, ...]]:
    """The names and shapes of `standalone_layer(layer)`'s state dict, read from `layer` without copying it (a
    large model's layer is gigabytes): each LoRA or `modules_to_save` wrapper read as the module it wraps."""
    shapes: dict[str, tuple[int, ...]] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        module = _wrapped(module)
        for name, param in module.named_parameters(recurse=False):
            shapes[prefix + name] = tuple(param.shape)
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                shapes[prefix + name] = tuple(buffer.shape)
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.")

    visit(layer, "")
    return shapes


def layer_with(layer: nn.Module, state: Mapping[str, Tensor]) -> nn.Module:
    """A standalone copy of `layer` (`standalone_layer`) holding the weights of `state` (each in the dtype of the
    weight it replaces), on the layer's device, frozen: what the healing student runs in place of `layer`."""
    clone = standalone_layer(layer)
    missing, unexpected = clone.load_state_dict(dict(state), strict=False)
    if missing or unexpected:
        raise ValueError(f"a layer replacement's weights do not fit {type(layer).__name__}: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return clone.requires_grad_(False).eval()


def substitutes(model: nn.Module, spec: BackboneSpec, states: Mapping[int, Mapping[str, Tensor]]) -> dict[int, nn.Module]:
    """`layer_with` for each replaced layer of `model`, keyed by its index (for `pruning.layers_removed`)."""
    layers = spec.get_layers(model)
    return {int(index): layer_with(layers[int(index)], state) for index, state in states.items()}


@contextlib.contextmanager
def forwards_substituted(layers: nn.ModuleList, substitutes: Mapping[int, nn.Module]) -> Iterator[None]:
    """Within the context layer i of `layers` computes `substitutes[i]`'s forward in place of its own while it stays
    in the decoder, so its hooks (the routers') and its cache slot are its own: the whole model runs the healing
    student's layers, for a skip policy that then removes the replaced span. Enter it *outside* a skip context,
    which patches the forward it finds."""
    substitutes = {int(i): module for i, module in substitutes.items()}
    saved = {i: layers[i].__dict__.get("forward") for i in substitutes}
    try:
        for i, module in substitutes.items():
            layers[i].forward = module.forward
        yield
    finally:
        for i, before in saved.items():
            if before is None:
                layers[i].__dict__.pop("forward", None)
            else:
                layers[i].forward = before


class _Stop(Exception):
    """Raised by a hook once the last layer a capture needs has run: the layers above it would be wasted work."""


def _to(value: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
    """`value` (a tensor, or tuples / dicts of them) on `device`; floating tensors in `dtype` where given."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype if dtype is not None and value.is_floating_point() else None)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value


def _captured(model: nn.Module, spec: BackboneSpec, batches: list[tuple[dict[str, Any], Tensor]], *,
              inputs_of: Iterable[int] = (), outputs_of: Iterable[int] = ()) -> list[dict[str, Any]]:
    """Per batch, on the CPU: for each layer i of `inputs_of`, the hidden states it is called with and its other
    keyword arguments (`in<i>`, `kwargs<i>`: a layer's attention mask can be its own, e.g. a sliding window), and
    the outputs of the layers `outputs_of` (`out<i>`). The forward stops after the last of them. Kept on the CPU: a
    large model's states for a few hundred batches would not fit beside it on a GPU."""

    layers = spec.get_layers(model)
    inputs_of, outputs_of = sorted(set(inputs_of)), sorted(set(outputs_of))
    last_input, last_output = max(inputs_of, default=-1), max(outputs_of, default=-1)
    store: dict[str, Any] = {}
    # The layers of one forward mostly share their keyword arguments (one mask, one rotary table): each is copied to
    # the CPU once per batch. The source is held beside its copy, so that its id cannot be reused in the meantime.
    moved: dict[int, tuple[Any, Any]] = {}

    def on_cpu(value: Any) -> Any:
        if id(value) not in moved:
            moved[id(value)] = (value, _to(value, "cpu"))
        return moved[id(value)][1]

    def take_input(index):
        def hook(_module, args, kwargs):
            store[f"in{index}"] = layer_hidden_states(args, kwargs).detach().cpu()
            store[f"kwargs{index}"] = {k: on_cpu(v) for k, v in kwargs.items() if k != "hidden_states"}
            if index == last_input and last_output < index:
                raise _Stop
        return hook

    def take_output(index):
        def hook(_module, _args, output):
            store[f"out{index}"] = layer_output(output).detach().cpu()
            if index == last_output and last_input <= index:
                raise _Stop
        return hook

    handles = [layers[i].register_forward_hook(take_output(i)) for i in outputs_of]
    handles += [layers[i].register_forward_pre_hook(take_input(i), with_kwargs=True) for i in inputs_of]
    captured = []
    try:
        for inputs, _ in batches:
            store.clear()
            moved.clear()
            try:
                unwrap_model(model)(**inputs, use_cache=False)
            except _Stop:
                pass
            else:
                raise RuntimeError(f"layer {max(last_input, last_output)} never ran: it cannot be captured for a "
                                   "layer replacement")
            captured.append(dict(store))
    finally:
        for handle in handles:
            handle.remove()
    return captured


def update_error(output: Tensor, target: Tensor, layer_input: Tensor, mask: Tensor) -> Tensor:
    """Mean over the `mask` positions of |output - target|^2 / |target - input|^2 per token: the squared error of
    the layer's update relative to the update it should write (the stream itself is dominated by a few huge
    coordinates that no layer here changes)."""
    goal = (target - layer_input)[mask].float()
    error = (output - target)[mask].float()
    return (error.pow(2).sum(-1) / goal.pow(2).sum(-1).clamp_min(1e-12)).mean()


def fit_layer_replacements(model: nn.Module, spec: BackboneSpec, layers: Iterable[int],
                           batches: Iterable[tuple[dict[str, Any], Tensor]], *, epochs: int = 4, lr: float = 2e-3,
                           seed: int = 0, span_inputs: Literal["replaced", "full"] = "replaced"
                           ) -> dict[int, dict[str, Tensor]]:
    """Train one layer replacement per removed span of `layers` (keyed by the layer in front of it), in depth order.

    `batches`: (forward keywords, bool mask [B, T] of the positions to fit on). The model runs as given (put routers
    and LoRA out of the way first): once in full, up to the last span's last layer, for every span's target (the
    full model's stream after it). Where a later span's replacement reads its input: `span_inputs="replaced"`, the
    model with the earlier spans removed and replaced (what the student runs it on; one more forward over the
    batches per span), or `"full"`, the full model's stream there, taken in that same single forward (a removal of
    several spans costs one forward instead of one per span; the error of the earlier replacements is left to
    what trains after). The replacement then trains `epochs` passes over what was captured (AdamW at `lr`, cosine
    to zero, the batches in a seeded order; fp32 weights, in eval mode as the student runs it). The layer in front
    starts from its own weights. Returns fp32 CPU state dicts of the plain layers.
    """
    from .pruning import layers_removed
    from .replacement import removed_spans, replaced_layers

    removed = sorted(set(int(i) for i in layers))
    spans, fronts = removed_spans(removed), replaced_layers(removed)
    batches = list(batches)
    decoder_layers = spec.get_layers(model)
    if not spans:
        return {}
    if not batches:
        raise ValueError("fit_layer_replacements needs at least one batch")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if span_inputs not in ("replaced", "full"):
        raise ValueError(f"span_inputs must be 'replaced' or 'full', got {span_inputs!r}")
    device = next(decoder_layers[fronts[0]].parameters()).device
    with torch.no_grad():
        full = _captured(model, spec, batches, inputs_of=fronts if span_inputs == "full" else fronts[:1],
                         outputs_of=[span[-1] for span in spans])
    masks = [mask.cpu() for _, mask in batches]
    generator = torch.Generator().manual_seed(seed)
    states: dict[int, dict[str, Tensor]] = {}
    for number, (front, span) in enumerate(zip(fronts, spans)):
        if number == 0 or span_inputs == "full":
            inputs, at = full, front
        else:  # the earlier spans removed and replaced renumber the layers: the front moves down by their length
            below = [layer for s in spans if s[-1] < span[0] for layer in s]
            at = front - len(below)
            with torch.no_grad(), layers_removed(model, spec, below, substitutes(model, spec, states)):
                inputs = _captured(model, spec, batches, inputs_of=[at])
        trained = standalone_layer(decoder_layers[front]).float().eval().requires_grad_(True)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=lr, weight_decay=0.0)
        # Without autocast the frozen weights' dtype (bf16) reaches the fp32 layer as is: fit it in fp32 throughout.
        dtype = None if torch.is_autocast_enabled(device.type) else torch.float32
        usable = [i for i, mask in enumerate(masks) if mask.any()]
        if not usable:
            raise ValueError("fit_layer_replacements: no batch has a position to fit on (every mask is empty)")
        total, step = epochs * len(usable), 0
        with torch.enable_grad():
            for _ in range(epochs):
                for index in torch.randperm(len(usable), generator=generator).tolist():
                    batch = usable[index]
                    layer_input = _to(inputs[batch][f"in{at}"], device, dtype)
                    target = _to(full[batch][f"out{span[-1]}"], device, dtype)
                    mask = masks[batch].to(device)
                    for group in optimizer.param_groups:
                        group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
                    output = trained(layer_input, **_to(inputs[batch][f"kwargs{at}"], device, dtype))
                    output = layer_output(output)
                    loss = update_error(output, target, layer_input, mask)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    step += 1
        states[front] = {name: value.detach().float().cpu().clone() for name, value in trained.state_dict().items()}
    return states
