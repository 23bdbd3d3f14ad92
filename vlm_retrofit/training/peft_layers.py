"""PEFT's adapter layers listed once per model, and switches over that list (the teacher's LoRA off; no fp32 input
copies under autocast; each LoRA linear as one fused matmul) that PEFT's own helpers make by walking every module of
the backbone on each call, or not at all."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from ..backbones.loading import floating_dtype, half_precision


def unmatched_lora_targets(model: nn.Module, target_modules: Any) -> list[str]:
    """The names of a list `target_modules` that no module of `model` is called, as PEFT matches them (the whole
    name or its last dotted parts): PEFT adapts the others and drops these silently. [] for a regex string or
    "all-linear", whose matching PEFT checks itself."""
    if not isinstance(target_modules, (list, tuple, set)):
        return []
    names = [name for name, _ in model.named_modules()]
    return [target for target in target_modules
            if not any(name == target or name.endswith("." + target) for name in names)]


def adapter_switches(model: nn.Module) -> list[nn.Module]:
    """What PEFT's `disable_adapter()` switches off: its tuner layers (LoRA, trainable tokens) and the wrappers of
    `modules_to_save` (empty without peft or without an adapter)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


def copies_trained_in_fp32(switches: list[nn.Module]) -> list[nn.Module]:
    """Give each `modules_to_save` copy of a half-precision backbone fp32 weights, as PEFT gives its LoRA weights,
    and its output back in the frozen weights' dtype; returns the copies changed.

    PEFT copies such a module (a norm, the head) in the frozen weights' dtype. bf16 stores a norm gain near 1 to
    2^-8 below 1 and 2^-7 above, so an AdamW step of ~lr rounds away for any lr under ~2e-3 to 4e-3 and the copy's
    weights would not move however long it trained. In fp32 it trains; a pre-hook hands it fp32 inputs (a bf16 input
    cannot multiply fp32 weights outside autocast, e.g. in generation) and a hook casts its output back, so the
    layers around it see the dtype they always did. Under autocast the copy's matmuls still run in bf16."""
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return []
    changed = []
    for wrapper in switches:
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        if not half_precision(wrapper.original_module):
            continue
        frozen = floating_dtype(wrapper.original_module)
        for copy in wrapper.modules_to_save.values():
            copy.float()
            copy.register_forward_pre_hook(functools.partial(_floating_inputs_as, torch.float32), with_kwargs=True)
            copy.register_forward_hook(functools.partial(_floating_output_as, frozen))
            changed.append(copy)
    return changed


def _as_dtype(value: Any, dtype: torch.dtype) -> Any:
    """`value` cast to `dtype` if it is a floating tensor (or a tuple / list of values), else as it is."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_as_dtype(v, dtype) for v in value)
    return value


def _floating_inputs_as(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return _as_dtype(args, dtype), {k: _as_dtype(v, dtype) for k, v in kwargs.items()}


def _floating_output_as(dtype: torch.dtype, module: nn.Module, args: tuple, output: Any) -> Any:
    return _as_dtype(output, dtype)


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
def lora_addmm(layers: list[nn.Module]) -> Iterator[None]:
    """Within the context, each plain LoRA linear of `layers` adds its update inside the matmul that forms it:
    `addmm(base(x), A(dropout(x)), B^T, alpha=scaling)`, one op where PEFT runs four (`B(...)`, `* scaling`, `+`,
    and the copy of `.to(dtype)`).

    A training step on CPU is bound by memory traffic wherever it does not multiply matrices, and PEFT's `result +
    lora_B(lora_A(x)) * scaling` reads and writes the projection's full output three more times forward and once
    more backward, for each of the seven projections of every layer. The sum is the same up to rounding (the product
    is scaled in the matmul's accumulator, not after a rounding to bf16). A layer falls back to PEFT's own forward
    whenever it is anything but one active vanilla adapter on a plain `nn.Linear` (adapters off or merged, a variant
    such as DoRA, a LoRA bias, mixed adapter batches, extra arguments) or, outside autocast, when its input, output
    and LoRA weights differ in dtype.
    """
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        yield
        return
    # Entered on every forward of a step, so kept to a type check per layer (the base layer is checked where the
    # layer runs: `get_base_layer()` costs ~3 us each) and plain dict writes (nn.Module's __setattr__ / __delattr__
    # search its parameter, buffer and module dicts first): ~1 ms -> ~0.1 ms for the 210 LoRA linears of 30 layers.
    plain = [layer for layer in layers if type(layer) is Linear]
    saved = [vars(layer).get("forward") for layer in plain]
    for layer in plain:
        vars(layer)["forward"] = functools.partial(_addmm_forward, layer)
    try:
        yield
    finally:
        for layer, before in zip(plain, saved):
            if before is None:
                del vars(layer)["forward"]
            else:
                vars(layer)["forward"] = before


def _addmm_forward(layer: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """`layer`'s forward as `lora_addmm` fuses it, or PEFT's where it does not apply."""
    names = layer.active_adapters
    name = names[0] if len(names) == 1 else None
    if (args or kwargs or layer.disable_adapters or layer.merged or name not in layer.lora_A
            or name in layer.lora_variant or layer.lora_B[name].bias is not None
            or not isinstance(layer.base_layer, nn.Linear)):
        return type(layer).forward(layer, x, *args, **kwargs)
    weight, base = layer.lora_B[name].weight, layer.base_layer
    if not torch.is_autocast_enabled(x.device.type) and not x.dtype == weight.dtype == base.weight.dtype:
        return type(layer).forward(layer, x, *args, **kwargs)
    result = base(x)
    update = layer.lora_A[name](layer.lora_dropout[name](x))
    fused = torch.addmm(result.reshape(-1, result.shape[-1]), update.reshape(-1, update.shape[-1]), weight.t(),
                        alpha=layer.scaling[name])
    return fused.view(result.shape)


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
