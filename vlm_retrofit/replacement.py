"""Linear replacement of removed layers: a least-squares map on the MLP output of the layer in front of each
removed span, foldable into that layer's output projection, so a pruned model costs nothing extra.

A decoder layer p adds its MLP output `m` to the stream: `y_p = h + m`. When layers p+1..b are removed, the
stream should instead have reached `y_b`, the full model's state after layer b. `fit_replacements` finds, per
removed span and in depth order, the `d x d` matrix T minimising `||h + m T - y_b||^2` over calibration tokens
(ridge-regularised normal equations; earlier spans already removed and replaced, so each fit also absorbs the
error accumulated below it). `h + m T` is what layer p computes with its output projection `W` replaced by
`T^T W`, which `fold_replacements` writes into the weights (ReplaceMe, Shopkhoev et al. 2025, does the same
training-free). `replacements_applied` applies T by hooks instead, for a student that shares its weights with an
unmodified teacher.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

from .backbones.registry import BackboneSpec, layer_output, unwrap_model
from .errors import InputError

__all__ = ["removed_spans", "output_projection", "fit_replacements", "replacements_applied", "fold_replacements",
           "replacements_folded", "check_replacements", "save_replacements", "load_replacements",
           "is_layer_replacement", "replacement_kind"]


def removed_spans(layers: Iterable[int]) -> list[list[int]]:
    """Maximal runs of consecutive layer indices, in depth order: [13, 14, 16, 17, 26] -> [[13, 14], [16, 17], [26]]."""
    spans: list[list[int]] = []
    for layer in sorted(set(int(i) for i in layers)):
        if spans and spans[-1][-1] == layer - 1:
            spans[-1].append(layer)
        else:
            spans.append([layer])
    return spans


def replaced_layers(layers: Iterable[int]) -> list[int]:
    """The layers whose output projection carries the replacement of each removed span (the one in front)."""
    spans = removed_spans(layers)
    if spans and spans[0][0] == 0:
        raise InputError("layer 0 is removed: a linear replacement needs a kept layer in front of every removed span")
    return [span[0] - 1 for span in spans]


def output_projection(spec: BackboneSpec, layer: nn.Module) -> nn.Module:
    """The linear layer whose output a decoder layer adds to the stream as its MLP update (`mlp.down_proj`)."""
    post_norm = next((name for name in POST_MLP_NORMS if isinstance(getattr(layer, name, None), nn.Module)), None)
    if spec.mlp_output_attr is None or post_norm:
        # A family may hold both layouts under one model_type (PaliGemma 1 and 2): the layer decides, not the spec.
        # Without a norm, the spec's None is all there is to say (a mixture of experts has no single projection).
        why = (f"normalise their MLP output before adding it to the stream ({post_norm})" if post_norm else
               "add no single linear layer's output to the stream as their MLP update (the family spec says so: "
               "mlp_output_attr None)")
        raise InputError(f"this backbone's layers {why}, so a linear replacement cannot be folded into its weights; "
                         "prune without replacement")
    module = layer
    for name in spec.mlp_output_attr.split("."):
        module = getattr(module, name, None)
        if module is None:
            raise InputError(f"{type(layer).__name__} has no {spec.mlp_output_attr!r} (the family spec's "
                             "mlp_output_attr: the linear layer whose output is the MLP update), where a linear "
                             "replacement would be folded; prune without replacement, or name it in the spec")
    return module


POST_MLP_NORMS = ("post_feedforward_layernorm", "post_mlp_layernorm")
"""Names of a norm that follows a layer's MLP (Gemma 2 / 3, and PaliGemma 2's Gemma 2 text)."""


@contextlib.contextmanager
def _forward_hooks(hooks: Iterable[tuple[nn.Module, Any]]) -> Iterator[None]:
    """Within the context each (module, hook) pair is registered as a forward hook."""
    handles = [module.register_forward_hook(hook) for module, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _captured(modules: Mapping[str, nn.Module]) -> Iterator[dict[str, Tensor]]:
    """Within the context, `store[name]` is the last output of `modules[name]` (forward hooks)."""
    store: dict[str, Tensor] = {}
    with _forward_hooks((module, lambda _m, _a, out, name=name: store.__setitem__(name, layer_output(out)))
                        for name, module in modules.items()):
        yield store


@contextlib.contextmanager
def replacements_applied(model: nn.Module, spec: BackboneSpec, transforms: Mapping[int, Tensor]) -> Iterator[None]:
    """Within the context layer p's MLP update is multiplied by `transforms[p]` (by hooks; weights untouched).
    Use it together with `layers_removed` on the spans the transforms were fitted for, entered *outside* it:
    `p` counts the full decoder's layers."""
    layers = spec.get_layers(model)

    def hook(transform: Tensor):
        return lambda _module, _args, output: output @ transform.to(device=output.device, dtype=output.dtype)

    with _forward_hooks((output_projection(spec, layers[int(i)]), hook(t)) for i, t in transforms.items()):
        yield


def is_layer_replacement(replacement: Any) -> bool:
    """Whether one replacement (a value of the transforms mapping) is a whole layer's weights
    (`vlm_retrofit.layer_replacement`: its state dict) rather than a linear map."""
    return isinstance(replacement, Mapping)


def replacement_kind(transforms: Mapping[int, Any]) -> str:
    """`layer` where the replacements are layer replacements, `linear` where they are linear maps (all are one or
    the other)."""
    kinds = {is_layer_replacement(v) for v in transforms.values()}
    if len(kinds) > 1:
        raise ValueError("one adapter's replacements are all linear maps or all layers, not both")
    return "layer" if kinds == {True} else "linear"


def _layer_tensor(layer: nn.Module, name: str) -> Tensor:
    try:
        return layer.get_parameter(name)
    except AttributeError:
        try:
            return layer.get_buffer(name)
        except AttributeError:
            raise InputError(f"{type(layer).__name__} has no plain weight {name!r} for its layer replacement: merge "
                             "LoRA into the weights (merge_and_unload) before folding, or refit it for this "
                             "backbone") from None


@torch.no_grad()
def fold_replacements(model: nn.Module, spec: BackboneSpec, transforms: Mapping[int, Any]) -> None:
    """Write the replacements into the weights, in place: a linear map into the output projection (`W <- T^T W`,
    `b <- b T`), a layer replacement's weights into the layer. Merge any LoRA first: a map acts on the
    projection's whole output, and a layer replacement takes the layer's place."""
    layers = spec.get_layers(model)
    for index, transform in transforms.items():
        if is_layer_replacement(transform):
            for name, value in transform.items():
                target = _layer_tensor(layers[int(index)], name)
                target.copy_(value.to(device=target.device, dtype=target.dtype))
            continue
        projection = output_projection(spec, layers[int(index)])
        if not isinstance(projection, nn.Linear):
            raise TypeError(f"layer {index}'s MLP output projection is a {type(projection).__name__}, not a plain "
                            "nn.Linear: merge LoRA into the weights (merge_and_unload) before folding")
        t = transform.to(device=projection.weight.device, dtype=torch.float64)  # fitted maps are kept on the CPU
        projection.weight.copy_((t.T @ projection.weight.to(torch.float64)).to(projection.weight.dtype))
        if projection.bias is not None:
            projection.bias.copy_((projection.bias.to(torch.float64) @ t).to(projection.bias.dtype))


@contextlib.contextmanager
def replacements_folded(model: nn.Module, spec: BackboneSpec, transforms: Mapping[int, Any]) -> Iterator[None]:
    """Within the context the replacements are folded into the weights (as a pruned release ships them); the
    original weights are restored exactly on exit."""
    layers = spec.get_layers(model)
    saved: list[tuple[Tensor, Tensor]] = []
    for index, transform in transforms.items():
        layer = layers[int(index)]
        if is_layer_replacement(transform):
            targets = [_layer_tensor(layer, name) for name in transform]
        else:
            projection = output_projection(spec, layer)
            targets = [t for t in (projection.weight, projection.bias) if t is not None]
        saved.extend((target, target.detach().clone()) for target in targets)
    fold_replacements(model, spec, transforms)
    try:
        yield
    finally:
        with torch.no_grad():
            for target, value in saved:
                target.copy_(value)


def check_replacements(transforms: Mapping[int, Any], removed: Iterable[int], fitted_for: Iterable[int], *,
                       hidden_size: int, source: str, layers: nn.ModuleList | None = None) -> None:
    """Refuse replacements fitted for another set of removed layers, or of the wrong width, naming both; a layer
    replacement's weights are checked against `layers[i]`'s (names and shapes) where `layers` is given."""
    removed, fitted_for = sorted(set(removed)), sorted(set(fitted_for))
    if removed != fitted_for:
        raise InputError(f"{source}: the replacement was fitted with layers {fitted_for} removed, but layers "
                         f"{removed} are removed now; prune exactly the fitted layers or drop the replacement")
    expected = replaced_layers(removed)
    if sorted(int(i) for i in transforms) != expected:
        raise InputError(f"{source}: replacements for layers {sorted(transforms)}, expected {expected}")
    bad: dict[int, Any] = {}
    for index, transform in transforms.items():
        if not is_layer_replacement(transform):
            if tuple(transform.shape) != (hidden_size, hidden_size):
                bad[int(index)] = tuple(transform.shape)
        elif layers is not None:
            from .layer_replacement import standalone_shapes

            own = standalone_shapes(layers[int(index)])
            given = {k: tuple(v.shape) for k, v in transform.items()}
            if own != given:
                bad[int(index)] = sorted(set(own.items()) ^ set(given.items()))[:4]
    if bad:
        raise InputError(f"{source}: replacements that do not fit this backbone (linear maps must be "
                         f"{hidden_size}x{hidden_size}; a layer's weights those of its layer): {bad}")


@torch.no_grad()
def fit_replacements(model: nn.Module, spec: BackboneSpec, layers: Iterable[int],
                     batches: Iterable[tuple[dict[str, Any], Tensor]], *, ridge: float = 0.1) -> dict[int, Tensor]:
    """Fit one `d x d` transform per removed span of `layers` (keyed by the layer in front of it), in depth order.

    `batches`: (forward keywords, bool mask [B, T] of the token positions to fit on). The model runs as given
    (put routers and skipping out of the way first). `ridge`, relative to the mean diagonal of `m^T m`, pulls T
    toward the identity (plain removal): with little calibration data the fit otherwise learns its noise (on
    SmolLM2 with 4 k calibration tokens, x1.45 perplexity at ridge 0.1 against x1.53 at 1e-3; with 12 k or more
    the two agree).
    """
    from .pruning import layers_removed  # pruning imports release, which reads replacements from here

    removed = sorted(set(int(i) for i in layers))
    spans = removed_spans(removed)
    fronts = replaced_layers(removed)
    batches = list(batches)
    decoder_layers = spec.get_layers(model)
    if not spans:
        return {}
    if max(removed) >= len(decoder_layers):
        raise ValueError(f"layers {removed} do not exist in a decoder of {len(decoder_layers)} layers")
    projections = {front: output_projection(spec, decoder_layers[front]) for front in fronts}
    if not batches:
        raise ValueError("fit_replacements needs at least one calibration batch")

    def run(inputs: dict[str, Any]) -> None:
        unwrap_model(model)(**inputs, use_cache=False)

    # The full model's stream after each span's last layer: the targets.
    targets: dict[int, list[Tensor]] = {front: [] for front in fronts}
    with _captured({str(front): decoder_layers[span[-1]] for front, span in zip(fronts, spans)}) as out:
        for inputs, mask in batches:
            run(inputs)
            for front in fronts:
                targets[front].append(out[str(front)][mask.to(out[str(front)].device)].double())
    transforms: dict[int, Tensor] = {}
    for front, span in zip(fronts, spans):
        below = [layer for s in spans if s[-1] < span[0] for layer in s]
        gram = cross = None
        watch = {"layer": decoder_layers[front], "update": projections[front]}
        with replacements_applied(model, spec, transforms), layers_removed(model, spec, below), _captured(watch) as out:
            for (inputs, mask), target in zip(batches, targets[front]):
                run(inputs)
                rows = mask.to(out["layer"].device)
                update = out["update"][rows].double()
                residual = out["layer"][rows].double() - update
                goal = target - residual
                gram = update.T @ update if gram is None else gram + update.T @ update
                cross = update.T @ goal if cross is None else cross + update.T @ goal
        # Ridge toward the identity (plain removal), not toward zero (dropping layer p's MLP update as well).
        damping = ridge * gram.diagonal().mean().clamp_min(1e-12) * torch.eye(gram.shape[0], dtype=gram.dtype,
                                                                               device=gram.device)
        transforms[front] = torch.linalg.solve(gram + damping, cross + damping).float().cpu()
    return transforms


REPLACEMENT_FILE = "replacement.safetensors"


def save_replacements(directory: str | os.PathLike, transforms: Mapping[int, Any], removed: Iterable[int]) -> Path:
    """Write `transforms` (linear maps `layer.<i>`, or layer replacements `layer.<i>.<weight name>`) and the removed
    layers they were fitted for into an adapter folder (atomically)."""
    from safetensors.torch import save_file

    from .files import atomic_write

    path = Path(directory) / REPLACEMENT_FILE
    kind = replacement_kind(transforms)
    tensors = {}
    for index, transform in transforms.items():
        items = transform.items() if is_layer_replacement(transform) else [(None, transform)]
        for name, value in items:
            key = f"layer.{int(index)}" if name is None else f"layer.{int(index)}.{name}"
            tensors[key] = value.detach().float().cpu().contiguous()
    metadata = {"removed_layers": json.dumps(sorted(int(i) for i in removed)),
                "kind": kind}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return path


def load_replacements(directory: str | os.PathLike) -> tuple[dict[int, Any], list[int]] | None:
    """(replacements, removed layers they were fitted for) from an adapter folder; None if it has none."""
    from safetensors import safe_open

    path = Path(directory) / REPLACEMENT_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        removed = json.loads(metadata.get("removed_layers", "null") or "null")
        kind = metadata.get("kind", "linear")
        if kind not in ("linear", "layer"):
            raise InputError(f"{path} holds a replacement of kind {kind!r}; this version reads 'linear' and 'layer'")
        transforms: dict[int, Any] = {}
        for key in f.keys():
            _, index, *name = key.split(".", 2)
            if kind == "layer":
                transforms.setdefault(int(index), {})[name[0]] = f.get_tensor(key)
            else:
                transforms[int(index)] = f.get_tensor(key)
    if removed is None:
        raise InputError(f"{path} does not say which layers its replacement was fitted for (no 'removed_layers' "
                         "metadata); refit it")
    return transforms, removed
