"""Invariant 2 as a check for a backbone spec: skipping with the KV cache generates what a no-cache reference does."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..backbones import KVPathError, resolve
from ..routing import RouterConfig, attach_routers, get_adapter
from .policies import RandomPolicy


@torch.no_grad()
def check_skip_consistency(model: nn.Module, inputs: Mapping[str, Any], config: RouterConfig | None = None, *,
                           rate: float = 0.45, seed: int = 3, new_tokens: int = 6, atol: float = 1e-4,
                           kv_rtol: float = 1e-5) -> float:
    """Attach fresh routers to `model`, generate greedily from `inputs` under random skipping with the KV cache
    and without it, detach, and return the max difference of their logits.

    With the cache, a skipped layer writes its K/V through the spec's kv-only path (input norm, k/v projections,
    k-norm, rotary: `BackboneSpec.attention_parts`); without it every step recomputes the sequence, applying the
    same skips. Identity at init (`check_identity`) never runs that path, so a spec can pass it and still break
    the cache. A tiny random model's logits hardly move when one layer caches wrong keys, so the cache itself is
    checked too: every layer's K/V after a run through the kv-only path must equal, within `kv_rtol` of their
    largest magnitude, those of the same run with the skipped layers run whole, and every kind of attention layer
    (`layer_types`) that may skip must have written through the kv-only path at least once. A block some tokens skip
    runs its MLP on the other tokens only (`BackboneSpec.mlp_attr`): a run with each MLP over every token must
    generate the same.

    Raises AssertionError naming what went wrong (the tokens, logits or cached K/V differ, a kind of layer went
    unchecked, or the kv-only path failed on this family's layers); the model is left as it was given. Use an
    input batch of one row: whole decoding steps then skip blocks, which is where the kv-only path runs.
    """
    if get_adapter(model) is not None:
        raise RuntimeError("check_skip_consistency needs a model without routers; detach the existing adapter first")
    was_training = model.training
    model.eval()
    adapter = attach_routers(model, config, freeze_base=False)
    policy = RandomPolicy(rate=rate, seed=seed)
    # A random model may emit an image placeholder, which the uncached re-run would take for an image.
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, suppress_tokens=sorted(resolve(model).image_token_ids(model.config)))
    try:
        with adapter.skipping(policy) as report:
            cached = model.generate(**inputs, **options)
        whole = adapter.skipping(policy)
        whole.kv_only_when_all_skip = False  # the skipped layers run and their output is discarded: real K/V
        with whole:
            through_layers = model.generate(**inputs, **options)
        dense = adapter.skipping(policy)
        dense.sparse_mlp = False  # each MLP runs over every token of a block some tokens skip
        with dense:
            dense_mlp = model.generate(**inputs, **options)
        with adapter.skipping(policy):
            reference = model.generate(**inputs, use_cache=False, **options)
    except KVPathError as error:  # refused by name: the message says what is wrong and what, if anything, to do
        raise AssertionError(f"skipping with the KV cache failed on {type(model).__name__}: {error}") from error
    except (AttributeError, TypeError, RuntimeError, ValueError, KeyError) as error:  # e.g. a rotary_fn of another signature
        raise AssertionError(f"skipping with the KV cache failed on {type(model).__name__}: {error!r}. The kv-only "
                             "path runs each skipped layer's input norm, k/v projections, k-norm and rotary embedding: "
                             "name them in the family's BackboneSpec (see docs/backbones.md)") from error
    finally:
        adapter.detach()
        model.train(was_training)
    if report.layer_calls["kv_only"] == 0:
        raise AssertionError(f"random skipping at rate {rate} wrote no K/V through the kv-only path on these inputs: "
                             "nothing was checked; give one row, more new tokens or a higher rate")
    _check_coverage(model, adapter.layout, report.kv_only_layers, config)
    if torch.equal(cached.sequences, through_layers.sequences):
        wrong = _differing_layers(cached.cache, through_layers.cache, kv_rtol)
        if wrong:
            raise AssertionError(f"the kv-only path caches other K/V than the layers themselves do ({'; '.join(wrong)})"
                                 f". It ran {_kv_path(model)}; check these against the attention's forward "
                                 "(BackboneSpec input_norm_attr, k_norm_attr, rotary_fn, uses_rotary)")
    mlp_difference = (torch.stack(cached.logits, 1) - torch.stack(dense_mlp.logits, 1)).abs().max().item()
    if not (torch.equal(cached.sequences, dense_mlp.sequences) and mlp_difference <= atol):
        raise AssertionError(f"running each MLP on the tokens that run its block only changes the logits (max "
                             f"difference {mlp_difference:.3g}) against running it over every token: BackboneSpec "
                             f"mlp_attr ({resolve(model).mlp_attr!r}) must name a position-wise MLP, or be None")
    difference = (torch.stack(cached.logits, 1) - torch.stack(reference.logits, 1)).abs().max().item()
    if not (torch.equal(cached.sequences, reference.sequences) and torch.equal(cached.sequences,
                                                                              through_layers.sequences)
            and difference <= atol):
        raise AssertionError(f"skipping with the KV cache generates other logits than without it (max difference "
                             f"{difference:.3g}): the kv-only path writes wrong K/V for this family. It ran "
                             f"{_kv_path(model)}; check these against the attention's forward (BackboneSpec "
                             "input_norm_attr, k_norm_attr, rotary_fn, uses_rotary)")
    return difference


def _differing_layers(cache: Any, reference: Any, rtol: float) -> list[str]:
    """The layers whose cached keys or values differ from the reference's by more than `rtol` of their scale."""
    wrong = []
    for index, (layer, expected) in enumerate(zip(cache.layers, reference.layers)):
        for name in ("keys", "values"):
            got, want = getattr(layer, name, None), getattr(expected, name, None)
            if got is None and want is None:  # a layer that caches nothing in either run
                continue
            if got is None or want is None or got.shape != want.shape:
                wrong.append(f"layer {index} {name}: shape {tuple(getattr(got, 'shape', ()))} against "
                             f"{tuple(getattr(want, 'shape', ()))}")
                continue
            scale = want.abs().max().clamp_min(torch.finfo(want.dtype).tiny)
            relative = ((got - want).abs().max() / scale).item()
            if not relative <= rtol:
                wrong.append(f"layer {index} {name} off by {relative:.2g} of their scale")
    return wrong


def _check_coverage(model: nn.Module, layout: Any, wrote: set[int], config: RouterConfig | None) -> None:
    """Refuse a check that left a kind of attention layer (`layer_types`) out: one that may skip but never wrote
    through the kv-only path, or one kept from skipping here only because the first and last blocks never skip (a
    deeper model of the family runs its kv-only path). Kinds that never skip in use (the spec's never-skip layers,
    as hybrids list their convolution layers, or blocks the caller's `config` keeps) need no kv-only path."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    if not layer_types or len(set(layer_types)) < 2:
        return
    skippable = set(layout.layers_of_blocks(layout.skippable_blocks))
    kept_by_spec = set(resolve(model).always_run_layers(model.config))
    caller_chose = config is not None and (config.never_skip_blocks is not None or config.skippable_blocks is not None)
    edges = set(layout.layers_of_blocks([0, len(layout.block_starts) - 1]))
    for kind in sorted(set(layer_types)):
        indices = [i for i, t in enumerate(layer_types) if t == kind]
        if not any(i in skippable for i in indices):
            if not caller_chose and any(i in edges and i not in kept_by_spec for i in indices):
                raise AssertionError(f"no {kind!r} layer (layers {indices}) may skip in this model (the first and "
                                     "last blocks never do), so its kv-only path goes unchecked: build the test model "
                                     "with more layers")
            continue
        if not wrote.intersection(indices):
            raise AssertionError(f"no {kind!r} layer (layers {indices}) wrote through the kv-only path on these "
                                 "inputs, so that kind went unchecked: give more new tokens or another seed")


def _kv_path(model) -> str:
    """What the kv-only path runs in each layer, in words (a differing layer stands out)."""
    spec = resolve(model)
    described = []
    for index, layer in enumerate(spec.get_layers(model)):
        try:
            parts = spec.attention_parts(layer)
        except TypeError:  # e.g. a convolution layer of a hybrid, which never skips
            described.append(f"layer {index}: no kv-only path")
            continue
        norm = type(parts.k_norm).__name__ if parts.k_norm is not None else "no key norm"
        rotary = getattr(parts.rotary_fn, "__qualname__", repr(parts.rotary_fn))
        described.append(f"layer {index}: {type(parts.input_norm).__name__}, {norm}, {rotary}")
    return "; ".join(described)
