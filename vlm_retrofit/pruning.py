"""Pruning: delete statically removed decoder layers from a model, so a plain model runs without them."""

from __future__ import annotations

import contextlib
import json
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from .backbones.loading import half_precision, weights_in_fp32
from .backbones.registry import BackboneSpec, unwrap_model
from .errors import InputError
from .release import RELEASE_CONFIG, RELEASE_FORMAT, RELEASE_FORMAT_VERSION, Loaded, real_logits, save_full_weights
from .replacement import check_replacements, fold_replacements, replacement_kind
from .routing import RouterAdapter, RouterConfig, attach_routers
from .skipping.accounting import weight_flops
from .skipping.calibrate import static_prefix, untrained_removal


def blocks_to_prune(adapter: RouterAdapter, *, blocks: Iterable[int] | None = None,
                    target_saving: float | None = None, allow_untrained: bool = False) -> list[int]:
    """The router blocks a pruned release removes: `blocks` as given, or those the static policy removes at
    `target_saving` (the stored `static` calibration for that target, else the prefix of the adapter's trained
    `removal_order`, the blocks its LoRA healing was trained without). Exactly one of the two.

    A removal the adapter was not trained for (`untrained_removal`: another count or other blocks than its
    removal schedule's) is refused unless `allow_untrained`: its LoRA would run on a model it never saw."""
    if (blocks is None) == (target_saving is None):
        raise InputError("say what to prune: either blocks or target_saving (not both)")
    layout = adapter.layout
    if blocks is None:
        stored = adapter.calibration.get("static", {}).get(f"{float(target_saving):.4f}")
        if stored is not None:
            blocks = stored["blocks"]
        elif adapter.removal_order is not None:
            blocks = static_prefix(list(adapter.removal_order), layout, float(target_saving))
        else:
            raise InputError(f"the adapter has no static calibration for target {target_saving} and no trained "
                             "removal_order: name the blocks to prune, or run `python -m vlm_retrofit calibrate "
                             "--policy static` first")
    chosen = sorted({int(b) for b in blocks})
    if not chosen:
        raise InputError("nothing to prune: the block list is empty")
    bad = [b for b in chosen if b not in layout.skippable_blocks]
    if bad:
        raise InputError(f"blocks {bad} cannot be pruned: the skippable blocks are {list(layout.skippable_blocks)}")
    fitted = [i for i in layout.layers_of_blocks(chosen)
              if str(i) in adapter.stand_ins and adapter.stand_ins[str(i)].fitted]
    if fitted:  # a pruned model deletes the layers outright: what their stand-ins computed would be lost unsaid
        raise InputError(f"layers {fitted} of blocks {chosen} have stand-ins (RouterConfig.skip_stand_in), which a "
                         "pruned release would drop: ship the adapter with its skip policy instead (a release "
                         "without pruning), or prune an adapter trained without stand-ins")
    problem = untrained_removal(adapter, chosen)
    if problem and not allow_untrained:
        raise InputError(f"{problem}. Prune one of those (--prune-target), retrain with min_removed_blocks / "
                         "max_removed_blocks covering this removal, or pass --allow-untrained-removal to prune it anyway")
    return chosen


def prune_layers(model: nn.Module, spec: BackboneSpec, layers: Iterable[int]) -> list[int]:
    """Delete decoder `layers` from `model` in place; returns the layers removed, ascending.

    The kept layers are renumbered (their `layer_idx`, hence their KV-cache slots), and the language config's
    `num_hidden_layers` and per-layer lists (`layer_types`, ...) shrink to match, so the model saves and
    reloads as a plain, shallower model of its own class. Layers at or before a layer where the backbone injects
    features by index (Qwen3-VL deepstack) are refused: removing them would shift the injection.
    """
    decoder = spec.get_decoder(model)
    full = getattr(decoder, spec.layers_attr)
    removed = sorted({int(i) for i in layers})
    if not removed:
        raise InputError("nothing to prune: the layer list is empty")
    if removed[0] < 0 or removed[-1] >= len(full):
        raise InputError(f"layers {removed} are out of range: the decoder has {len(full)} layers")
    if len(removed) == len(full):
        raise InputError("pruning every decoder layer leaves no model")
    injected = sorted(spec.feature_injection_layers(unwrap_model(model).config))
    if injected and removed[0] <= injected[-1]:
        raise InputError(f"cannot prune layers {removed}: the backbone injects features at layers {injected} by "
                         f"index; only layers after {injected[-1]} can be pruned")
    _delete_layers(model, spec, full, set(removed))
    return removed


@contextlib.contextmanager
def layers_removed(model: nn.Module, spec: BackboneSpec, layers: Iterable[int],
                   substitutes: Mapping[int, nn.Module] | None = None) -> Iterator[None]:
    """Within the context the decoder runs without `layers` exactly as the pruned model (`prune_layers`) does:
    the kept layers renumbered, the config's per-layer lists shrunk (Gemma 3 picks each layer's mask and rotary
    embedding by its position in them); all restored on exit. For measuring and training, not for saving.
    `substitutes` {i: module} runs module in place of kept layer i (a layer replacement's weights,
    `vlm_retrofit.layer_replacement`), numbered as that layer.
    """
    decoder = spec.get_decoder(model)
    full = getattr(decoder, spec.layers_attr)
    removed = {int(i) for i in layers}
    substitutes = {int(i): module for i, module in (substitutes or {}).items()}
    if not removed and not substitutes:
        yield
        return
    if removed and (min(removed) < 0 or max(removed) >= len(full)):
        raise InputError(f"layers {sorted(removed)} are out of range: the decoder has {len(full)} layers")
    if set(substitutes) & removed or any(not 0 <= i < len(full) for i in substitutes):
        raise InputError(f"layers {sorted(substitutes)} to run substitutes for must be kept layers of the decoder")
    text_config = spec.get_text_config(model)
    settings = {name: getattr(text_config, name) for name in [*_per_layer_settings(text_config, len(full)),
                                                              "num_hidden_layers"]}
    numbering = [(module, module.layer_idx) for layer in [*full, *substitutes.values()]
                 for module in _indexed_modules(layer)]
    try:
        _delete_layers(model, spec, nn.ModuleList(substitutes.get(i, layer) for i, layer in enumerate(full)), removed)
        yield
    finally:
        setattr(decoder, spec.layers_attr, full)
        for module, index in numbering:
            module.layer_idx = index
        for name, value in settings.items():
            setattr(text_config, name, value)


def _delete_layers(model: nn.Module, spec: BackboneSpec, full: nn.ModuleList, removed: set[int]) -> None:
    """Keep the layers of `full` not in `removed`, renumbered (their `layer_idx`, hence their KV-cache slots),
    and shrink the language config to match."""
    kept = [layer for i, layer in enumerate(full) if i not in removed]
    setattr(spec.get_decoder(model), spec.layers_attr, nn.ModuleList(kept))
    for index, layer in enumerate(kept):
        for module in _indexed_modules(layer):
            module.layer_idx = index
    text_config = spec.get_text_config(model)
    for name in _per_layer_settings(text_config, len(full)):
        value = getattr(text_config, name)
        setattr(text_config, name, type(value)(v for i, v in enumerate(value) if i not in removed))
    text_config.num_hidden_layers = len(full) - len(removed)


_INDEXED_MODULES: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()


def _indexed_modules(layer: nn.Module) -> list[nn.Module]:
    """The modules of decoder `layer` that carry its index (`layer_idx`: the layer, its attention), found once per
    layer. Healing removes layers at every training step, and walking every module of 30 LoRA-wrapped layers twice
    cost ~20 ms a step; adapters wrap projections, never these modules."""
    found = _INDEXED_MODULES.get(layer)
    if found is None:
        found = [module for module in layer.modules() if isinstance(getattr(module, "layer_idx", None), int)]
        _INDEXED_MODULES[layer] = found
    return found


def _per_layer_settings(text_config: Any, num_layers: int) -> list[str]:
    # Per-layer settings are lists indexed by layer (layer_types: sliding vs full attention, ...).
    return [name for name, value in vars(text_config).items()
            if "layer" in name and isinstance(value, (list, tuple)) and len(value) == num_layers]


# -- pruned releases (written by `vlm_retrofit.release.merge`) ----------------------------------------------
def prune_for_release(loaded: Loaded, blocks: list[int], inputs: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
    """Merge any LoRA, then delete `blocks`' layers from the weights and drop the routers (in place).

    Returns the pruned model, the logits it must reproduce (the same weights with the blocks removed by the
    static policy at *identity* routers, i.e. plain layer removal through the skip machinery: an independent
    reference) and what dropping the trained routers changes on `inputs` (KL and top-1 agreement vs the routed
    model with the same blocks removed).
    """
    model, adapter = loaded.model, loaded.adapter
    layers = adapter.layout.layers_of_blocks(blocks)
    if loaded.replacement is not None:  # refused before any work when fitted for other layers
        transforms, fitted_for = loaded.replacement
        hidden_size = int(adapter.spec.get_text_config(model).hidden_size)
        check_replacements(transforms, layers, fitted_for, hidden_size=hidden_size, source="the adapter",
                           layers=adapter.spec.get_layers(model))
    if loaded.lora:
        model = adapter.merge_lora()
    if loaded.replacement is not None:  # acts on the merged projection, as it did in training
        fold_replacements(model, adapter.spec, loaded.replacement[0])
    num_layers, spec, router_config = adapter.layout.num_layers, adapter.spec, adapter.config
    # The skip machinery sums the stream in fp32 and a plain model in its weights' dtype, so a half-precision
    # model's reference is computed in fp32 on the same weights (and `merge` checks the release loaded in fp32).
    with weights_in_fp32(model) if half_precision(model) else contextlib.nullcontext():
        with adapter.skipping("static", blocks=blocks):
            routed = real_logits(model, inputs)
        adapter.detach()
        identity = attach_routers(model, RouterConfig.from_dict(router_config.to_dict()))
        with identity.skipping("static", blocks=blocks):
            expected = real_logits(model, inputs)
        identity.detach()
    trained_for = None if adapter.removal_range is None else untrained_removal(adapter, blocks) is None
    # Per token and context-free, from each layer's weights: a hybrid's or a mixture's layers differ in cost.
    text_config = spec.get_text_config(model)
    layer_flops = [weight_flops(layer, text_config) for layer in spec.get_layers(model)]
    removed = prune_layers(model, spec, layers)
    routed_log, plain_log = torch.log_softmax(routed, -1), torch.log_softmax(expected, -1)
    summary = {
        "removed_blocks": blocks, "removed_layers": removed, "num_layers_before": num_layers,
        "layer_compute_removed": sum(layer_flops[i] for i in removed) / sum(layer_flops),
        # Whether training removed exactly these blocks (None: it removed none, e.g. routers alone at identity).
        "removal_trained": trained_for,
        # Layers (numbered as before pruning) carrying the folded replacement: a linear one in their down projection,
        # a layer replacement as their weights.
        "replacement_folded_into": sorted(loaded.replacement[0]) if loaded.replacement is not None else None,
        "replacement_kind": None if loaded.replacement is None else replacement_kind(loaded.replacement[0]),
        "routers_dropped": {  # on the merge's sample inputs
            "kl_routed_to_pruned": float((routed_log.exp() * (routed_log - plain_log)).sum(-1).mean()),
            "top1_agreement": float((routed.argmax(-1) == expected.argmax(-1)).float().mean()),
        },
    }
    return model, expected, summary


def write_pruned_release(loaded: Loaded, model: nn.Module, directory: Path, pruned: dict[str, Any]) -> None:
    directory.mkdir(parents=True)
    save_full_weights(model, directory / "model")
    loaded.processor.save_pretrained(directory / "processor")
    base_model = dict(loaded.base_model)
    base_model["attn_implementation"] = base_model.get("attn_implementation") or unwrap_model(model).config._attn_implementation
    config = {
        "format": RELEASE_FORMAT,
        "format_version": RELEASE_FORMAT_VERSION,
        "base_model": base_model,
        "base_fingerprint": loaded.adapter.fingerprint,  # of the unpruned base it was merged from
        "full_weights": True,
        "lora": "merged" if loaded.lora else None,
        "pruned": pruned,
    }
    (directory / RELEASE_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "README.md").write_text(_pruned_model_card(config))


def _pruned_model_card(config: dict[str, Any]) -> str:
    pruned, name = config["pruned"], config["base_model"]["name"]
    dropped = pruned["routers_dropped"]
    return "\n".join([
        f"# {name}, pruned by vlm_retrofit",
        "",
        f"Decoder layers {pruned['removed_layers']} of {pruned['num_layers_before']} are deleted from the weights "
        f"({100 * pruned['layer_compute_removed']:.1f} % of decoder-layer compute)"
        + (", with the LoRA that healed their removal merged in." if config["lora"] and pruned.get("removal_trained")
           else ", with the adapter's LoRA merged in." if config["lora"] else "."),
        *(["The adapter was trained for another removal than this one (merged with --allow-untrained-removal): its "
           "healing did not see this model."] if pruned.get("removal_trained") is False else []),
        *([f"Layers {pruned['replacement_folded_into']} (numbered as before pruning) were retrained to write what "
           "the removed span after each wrote as well (a layer replacement): their weights are new."]
          if pruned.get("replacement_folded_into") and pruned.get("replacement_kind") == "layer" else
          [f"A linear replacement of the removed spans is folded into the MLP output projections of layers "
           f"{pruned['replacement_folded_into']} (numbered as before pruning)."]
          if pruned.get("replacement_folded_into") else []),
        "The trained depth routers were dropped: this is a plain model of the base's class, loadable with",
        "`transformers` alone from `model/` (processor in `processor/`), or with `vlm_retrofit.load_release`.",
        "",
        "Dropping the routers, measured on the merge's sample inputs against the routed model with the same blocks",
        f"removed: KL {dropped['kl_routed_to_pruned']:.4g} nats per position, top-1 agreement "
        f"{dropped['top1_agreement']:.3f}. Measure quality on your own data before shipping.",
        "",
    ])
