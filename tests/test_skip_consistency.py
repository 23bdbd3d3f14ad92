"""Invariants 2 and 3 on every family: cached skipping equals a no-cache reference; a never-firing policy is exact."""

import pytest
import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from vlm_retrofit import RouterConfig, attach_routers
from vlm_retrofit.backbones import resolve
from vlm_retrofit.skipping import RandomPolicy, RecentWeightPolicy, StaticPolicy
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm

NEW_TOKENS = 6


def _trained_like(family, **overrides):
    """A tiny model with routers whose queries are far from init, so routing really re-weights sources."""
    model, processor = tiny_vlm(family, num_hidden_layers=6, **overrides)
    adapter = attach_routers(model, RouterConfig())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for router in adapter.routers.values():
            router.query.copy_(0.5 * torch.randn(router.query.shape, generator=generator))
    return model, processor, adapter


def _no_placeholders(model):
    """Random tiny models may emit an image placeholder id, which an uncached re-run would treat as an image."""
    return {"suppress_tokens": sorted(resolve(model).image_token_ids(model.config))}


def _generate(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, **_no_placeholders(model), **kwargs)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_skipping_equals_uncached_reference(family, batch):
    model, processor, adapter = _trained_like(family)
    inputs = tiny_inputs(processor, batch=batch)
    policy = RandomPolicy(rate=0.45, seed=3)
    with torch.no_grad():
        with adapter.skipping(policy) as report:
            out = _generate(model, inputs)
        # The reference recomputes the whole sequence at every step, applying where(skip, x, layer(x)) per layer.
        with adapter.skipping(policy) as reference_report:
            reference = _generate(model, inputs, use_cache=False)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(reference.logits, 1), atol=1e-4, rtol=0)
    assert torch.equal(out.sequences, reference.sequences)
    # Skipping really happened; at batch 1 whole steps skip blocks, so kv-only writes ran and saved compute.
    assert sum(report.block_skipped_tokens) > 0 and report.layer_calls["mixed"] > 0
    if batch == 1:
        assert report.layer_calls["kv_only"] > 0 and report.decode.compute_saved > 0
    assert reference_report.layer_calls["kv_only"] == 0  # no cache: nothing to fill


@pytest.mark.parametrize("family", FAMILIES)
def test_never_firing_threshold_reproduces_unskipped_generation(family):
    model, processor, adapter = _trained_like(family)
    inputs = tiny_inputs(processor, batch=2)
    with torch.no_grad():
        plain = _generate(model, inputs)
        with adapter.skipping("recent_weight", thresholds=1.5) as report:  # alpha <= 1: never fires
            never = _generate(model, inputs)
    assert torch.equal(never.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(never.logits, plain.logits))
    assert report.compute_saved == 0 and report.layer_calls["full"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_never_firing_threshold_at_init_equals_the_base(family):
    model, processor = tiny_vlm(family)
    inputs = tiny_inputs(processor, batch=2)
    with torch.no_grad():
        base = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        adapter = attach_routers(model, RouterConfig())
        with adapter.skipping("recent_weight", thresholds=1.5):
            retrofit = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(base, retrofit)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["beam", "sample", "static_cache"])
@pytest.mark.parametrize("policy_name", ["recent_weight", "static"])
def test_generation_modes_match_uncached_generation(family, mode, policy_name):
    """Beam search, sampling and a static cache under skipping equal `generate(use_cache=False)`.

    Static removal leaves the removed layers' caches unwritten, which beam reordering and a preallocated
    cache must tolerate as well.
    """
    model, processor, adapter = _trained_like(family)
    inputs = tiny_inputs(processor, batch=2)
    options = {
        "beam": dict(num_beams=2, do_sample=False),
        "sample": dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0),
        "static_cache": dict(do_sample=False, cache_implementation="static"),
    }[mode]
    policy = {  # recent_weight fires on part of the tokens of these routers
        "recent_weight": RecentWeightPolicy(thresholds=0.45),
        "static": StaticPolicy(blocks=list(adapter.layout.skippable_blocks[:2])),
    }[policy_name]

    def run(use_cache):
        torch.manual_seed(11)
        with torch.no_grad(), adapter.skipping(policy) as report:
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, use_cache=use_cache, **options,
                                 **_no_placeholders(model))
        return out, report

    cached, report = run(True)
    uncached, _ = run(False)
    assert torch.equal(cached, uncached)
    assert sum(report.block_skipped_tokens) > 0
    # A static cache reports its length as a tensor: the FLOP counts must stay plain numbers.
    assert all(type(v) is int for v in (report.decode.executed_flops, report.decode.full_flops)) and report.decode.forwards


SLIDING_ONLY = dict(use_sliding_window=True, sliding_window=512, max_window_layers=0,
                    layer_types=["sliding_attention"] * 6)
"""A Qwen2 whose every layer attends over a sliding window: `generate` gives it no full-attention mask."""


@pytest.mark.parametrize("family, overrides", [*((f, {}) for f in FAMILIES), ("qwen2", SLIDING_ONLY)],
                         ids=[*FAMILIES, "qwen2-sliding-only"])
def test_a_static_cache_sees_the_padding_of_a_left_padded_batch(family, overrides):
    """With a static cache `generate` hands the model 4-D masks: random skipping must still decide by each token's
    own position and the report count real tokens only, as with the default cache. Before, both took padding as
    tokens there: other decisions, other answers."""
    model, processor, adapter = _trained_like(family, **overrides)
    inputs = tiny_inputs(processor, batch=2)
    assert not inputs["attention_mask"].all()

    def run(cache_implementation):
        with torch.no_grad(), adapter.skipping(RandomPolicy(rate=0.45, seed=3)) as report:
            out = _generate(model, inputs, cache_implementation=cache_implementation)
        return out, report

    (dynamic, dynamic_report), (static, static_report) = run(None), run("static")
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits, 1), torch.stack(dynamic.logits, 1), atol=1e-4, rtol=0)
    assert static_report.block_tokens == dynamic_report.block_tokens
    assert static_report.block_skipped_tokens == dynamic_report.block_skipped_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_only_cache_write_equals_what_the_attention_layer_writes(family):
    """The kv-only path must leave exactly the K/V the real layer would have cached for the same input."""
    model, processor, adapter = _trained_like(family)
    inputs = tiny_inputs(processor, batch=1)
    policy = RandomPolicy(rate=0.6, seed=4)

    def run(kv_only_path):
        controller = adapter.skipping(policy)
        controller.kv_only_when_all_skip = kv_only_path
        with torch.no_grad(), controller as report:
            out = _generate(model, inputs)
        return out, report

    fast, fast_report = run(True)
    slow, slow_report = run(False)
    assert fast_report.layer_calls["kv_only"] > 0 and slow_report.layer_calls["kv_only"] == 0
    assert torch.equal(fast.sequences, slow.sequences)
    for fast_layer, slow_layer in zip(fast.past_key_values.layers, slow.past_key_values.layers):
        if isinstance(slow_layer, LinearAttentionCacheLayerMixin):  # a hybrid's convolution layer: it always runs
            torch.testing.assert_close(fast_layer.conv_states, slow_layer.conv_states, atol=1e-6, rtol=0)
            continue
        torch.testing.assert_close(fast_layer.keys, slow_layer.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(fast_layer.values, slow_layer.values, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_removal_writes_no_cache_for_removed_blocks_and_equals_the_uncached_reference(family):
    """No token ever runs a statically removed block, so its cache is never read: none is written."""
    model, processor, adapter = _trained_like(family)
    inputs = tiny_inputs(processor, batch=2)
    blocks = list(adapter.layout.skippable_blocks[:2])
    with torch.no_grad():
        controller = adapter.skipping("static", blocks=blocks)
        with controller as report:
            out = _generate(model, inputs)
        with adapter.skipping("static", blocks=blocks):
            reference = _generate(model, inputs, use_cache=False)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(reference.logits, 1), atol=1e-4, rtol=0)
    assert torch.equal(out.sequences, reference.sequences)
    # Layer 0 and the first layer of each attention type size HF's masks: a block holding one keeps kv-only.
    cacheless = adapter.layout.layers_of_blocks(controller.cacheless_blocks)
    assert cacheless and set(controller.cacheless_blocks) <= set(blocks)
    layers = out.past_key_values.layers
    # A hybrid's convolution layers (LFM2) never skip: each holds its conv state, no K/V.
    states = {i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}
    assert not states & set(cacheless) and all(layers[i].is_conv_states_initialized[0] for i in states)
    lengths = [layer.keys.shape[2] if i not in states and layer.is_initialized else 0 for i, layer in enumerate(layers)]
    assert all(lengths[i] == 0 for i in cacheless)
    assert all(length > 0 for i, length in enumerate(lengths) if i not in set(cacheless) | states)
    assert report.layer_calls["skipped"] > 0 and report.decode.compute_saved > 0
    kept_kv = set(blocks) - set(controller.cacheless_blocks)
    assert (report.layer_calls["kv_only"] > 0) == bool(kept_kv)


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_on_running_tokens_only_equals_the_whole_layer_and_counts_what_it_spared(family):
    """A block some tokens skip runs its MLP on the others only: the same tokens and logits as running it over every
    token and discarding the skipping ones', and the spared MLP rows are counted as saved compute."""
    model, processor, adapter = _trained_like(family)
    inputs = tiny_inputs(processor, batch=2)
    policy = RandomPolicy(rate=0.45, seed=3)
    runs = {}
    with torch.no_grad():
        for sparse in (True, False):
            controller = adapter.skipping(policy)
            controller.sparse_mlp = sparse
            with controller as report:
                runs[sparse] = _generate(model, inputs), report
    (out, sparse_report), (whole, whole_report) = runs[True], runs[False]
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(whole.logits, 1), atol=1e-5, rtol=0)
    assert torch.equal(out.sequences, whole.sequences)
    assert sparse_report.layer_calls == whole_report.layer_calls and sparse_report.layer_calls["mixed"] > 0
    assert sparse_report.full_flops == whole_report.full_flops
    assert sparse_report.decode.executed_flops < whole_report.decode.executed_flops  # mixed decode steps at batch 2
    assert sparse_report.prefill.executed_flops < whole_report.prefill.executed_flops
