"""Invariant 2 as a check for a backbone spec: skipping with the KV cache generates what a no-cache reference does."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..backbones import resolve
from ..routing import RouterConfig, attach_routers, get_adapter
from .policies import RandomPolicy


@torch.no_grad()
def check_skip_consistency(model: nn.Module, inputs: Mapping[str, Any], config: RouterConfig | None = None, *,
                           rate: float = 0.45, seed: int = 3, new_tokens: int = 6, atol: float = 1e-4) -> float:
    """Attach fresh routers to `model`, generate greedily from `inputs` under random skipping with the KV cache
    and without it, detach, and return the max difference of their logits.

    With the cache, a skipped layer writes its K/V through the spec's kv-only path (input norm, k/v projections,
    k-norm, rotary: `BackboneSpec.attention_parts`); without it every step recomputes the sequence, applying the
    same skips. Identity at init (`check_identity`) never runs that path, so a spec can pass it and still break
    the cache. Raises AssertionError naming what went wrong (the tokens or logits differ, or the kv-only path
    failed on this family's layers); the model is left as it was given. Use an input batch of one row: whole
    decoding steps then skip blocks, which is where the kv-only path runs.
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
        with adapter.skipping(policy):
            reference = model.generate(**inputs, use_cache=False, **options)
    except (AttributeError, TypeError, RuntimeError, ValueError) as error:  # e.g. a rotary_fn of another signature
        raise AssertionError(f"skipping with the KV cache failed on {type(model).__name__}: {error}. The kv-only path "
                             "runs each skipped layer's input norm, k/v projections, k-norm and rotary embedding: "
                             "name them in the family's BackboneSpec (see docs/backbones.md)") from error
    finally:
        adapter.detach()
        model.train(was_training)
    if report.layer_calls["kv_only"] == 0:
        raise AssertionError(f"random skipping at rate {rate} wrote no K/V through the kv-only path on these inputs: "
                             "nothing was checked; give one row, more new tokens or a higher rate")
    difference = (torch.stack(cached.logits, 1) - torch.stack(reference.logits, 1)).abs().max().item()
    if not torch.equal(cached.sequences, reference.sequences) or not difference <= atol:
        raise AssertionError(f"skipping with the KV cache generates other logits than without it (max difference "
                             f"{difference:.3g}): the kv-only path writes wrong K/V for this family. It ran "
                             f"{_kv_path(model)}; check these against the attention's forward (BackboneSpec "
                             "input_norm_attr, k_norm_attr, rotary_fn, uses_rotary)")
    return difference


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
