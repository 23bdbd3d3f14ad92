"""The per-layer cost model: sliding windows as HF's masks apply them, and each layer's own weights measured."""

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, MistralConfig

from vlm_retrofit import RouterConfig, attach_routers
from vlm_retrofit.skipping import LayerCost, PatternPolicy
from vlm_retrofit.skipping.accounting import sliding_window_of
from vlm_retrofit.backbones import resolve
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm


def _attended_pairs(past: int, new_tokens: int, window: int | None) -> int:
    """(query, key) pairs a causal, optionally sliding mask lets through, counted one by one."""
    pairs = 0
    for q in range(past, past + new_tokens):
        for k in range(q + 1):
            pairs += window is None or k > q - window  # transformers.masking_utils.sliding_window_overlay
    return pairs


@pytest.mark.parametrize("window", [None, 1, 4, 16])
@pytest.mark.parametrize("past,new_tokens", [(0, 1), (0, 3), (0, 16), (0, 40), (5, 1), (15, 1), (16, 1), (30, 7), (2, 30)])
def test_attention_flops_count_the_pairs_the_mask_lets_through(window, past, new_tokens):
    cost = LayerCost(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16, sliding_window=window)
    per_pair = 2 * 2 * 2 * 4
    assert cost.attention(new_tokens, past + new_tokens) == per_pair * _attended_pairs(past, new_tokens, window)


def test_each_layer_gets_the_window_its_family_applies():
    gemma, _ = tiny_vlm("gemma3", num_hidden_layers=4)
    text = gemma.config.text_config
    assert [sliding_window_of(text, i) for i in range(4)] == [16, None, 16, None]  # layer_types alternate
    mistral = MistralConfig(num_hidden_layers=3, sliding_window=32)  # no layer_types: every layer slides
    assert [sliding_window_of(mistral, i) for i in range(3)] == [32, 32, 32]
    assert [sliding_window_of(LlamaConfig(num_hidden_layers=2), i) for i in range(2)] == [None, None]
    assert LayerCost.from_config(text).sliding_window is None  # no layer given: a full-attention layer


def test_skip_report_counts_sliding_layers_over_their_window():
    # gemma3 tiny: layers 0 and 2 slide over 16 keys, 1 and 3 attend to everything. A prompt longer than the
    # window, then one decode step; block 2 (a sliding layer) is skipped by every token (kv-only).
    model, processor = tiny_vlm("gemma3", num_hidden_layers=4)
    adapter = attach_routers(model, RouterConfig())
    text = model.config.text_config
    inputs = tiny_inputs(processor, batch=1, with_image=False)
    length = inputs["input_ids"].shape[1]
    prompt = torch.cat([inputs["input_ids"]] * (40 // length + 1), dim=1)[:, :40]
    sliding, full = LayerCost.from_config(text, 0), LayerCost.from_config(text, 1)
    assert (sliding.sliding_window, full.sliding_window) == (16, None)
    policy = PatternPolicy(lambda block, state: torch.ones(state.routed_input.shape[:-1], dtype=torch.bool) if block == 2 else None)
    with torch.no_grad(), adapter.skipping(policy) as report:
        cache = DynamicCache(config=text)
        model(input_ids=prompt, cache=cache, use_cache=True)
        model(input_ids=prompt[:, :1], cache=cache, use_cache=True)
    per_pair = 2 * 2 * text.num_attention_heads * text.head_dim
    prefill = {w: 40 * sliding.dense + per_pair * _attended_pairs(0, 40, w) for w in (16, None)}
    decode = {w: sliding.dense + per_pair * _attended_pairs(40, 1, w) for w in (16, None)}
    assert prefill[16] < prefill[None] and decode[16] < decode[None]
    assert report.prefill.full_flops == 2 * prefill[16] + 2 * prefill[None]
    assert report.prefill.executed_flops == prefill[16] + 2 * prefill[None] + 40 * sliding.kv_projection
    assert report.decode.full_flops == 2 * decode[16] + 2 * decode[None]
    assert report.decode.executed_flops == decode[16] + 2 * decode[None] + sliding.kv_projection


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_costs_are_measured_from_each_layers_weights(family):
    # The config's sizes say what a dense layer costs, not a mixture of experts or a hybrid's convolution layer.
    model, _ = tiny_vlm(family, num_hidden_layers=6)
    spec = resolve(model)
    text = spec.get_text_config(model)
    measured = LayerCost.per_layer(text, 6, spec.get_layers(model), spec.attention_attr)
    from_config = LayerCost.per_layer(text, 6)
    d, mlp = 64, 3 * 2 * 64 * 128  # the tiny decoders: width 64, gated MLP 128
    attention = 2 * d * 64 + 4 * d * 32 + 2 * 64 * d  # q, k + v (2 kv heads of 16), o
    # Qwen3.5's Gated DeltaNet (layer 1 of its tiny models), keys 2 x 8, values 4 x 8: in_proj_qkv 64 -> 64,
    # in_proj_z 64 -> 32, in_proj_b / _a 64 -> 4 each, out_proj 32 -> 64, a depthwise kernel of 4 over q, k, v.
    delta_net = 2 * d * 64 + 2 * d * 32 + 2 * 2 * d * 4 + 2 * 32 * d + 2 * 64 * 4
    if family == "qwen3_vl_moe":  # router [4, 64]; 4 experts of width 32, 2 of them per token
        assert {c.dense for c in measured} == {attention + 2 * 4 * d + 3 * 2 * d * 32 * 4 * 2 // 4}
    elif family == "lfm2_vl":  # layer 1 convolves: in_proj 64 -> 3 x 64, out_proj, a depthwise kernel of 3
        conv = measured[1]
        assert not conv.attends and conv.attention(5, 40) == 0
        assert conv.dense == 2 * d * 3 * d + 2 * d * d + 2 * d * text.conv_L_cache + mlp
        assert [c.dense for i, c in enumerate(measured) if i != 1] == [attention + mlp] * 5
    elif family == "qwen3_5_moe":  # qwen3_5's layers; a router [4, 64], 4 experts of width 32 (2 per token), and a
        # shared expert of width 32 with its gate [1, 64]. The config formula's MLP is the width a token runs: 2 x 32 + 32.
        moe = 2 * 4 * d + 3 * 2 * d * 32 * 4 * 2 // 4 + 3 * 2 * d * 32 + 2 * d
        assert [c.dense for c in measured] == [delta_net + moe if i == 1 else attention + 2 * d * 64 + moe
                                               for i in range(6)]
        assert {c.dense for c in from_config} == {attention + 3 * 2 * d * (2 * 32 + 32)}
        assert [c.attends for c in measured] == [i != 1 for i in range(6)]
    elif family == "qwen3_5":  # layer 1 is a Gated DeltaNet; the attention layers' q_proj doubles as a gate
        assert [c.dense for c in measured] == [delta_net + mlp if i == 1 else attention + 2 * d * 64 + mlp
                                               for i in range(6)]
        assert [c.attends for c in measured] == [i != 1 for i in range(6)]
    else:  # a dense layer: the measured cost is the config formula's
        assert [c.dense for c in measured] == [c.dense for c in from_config] == [attention + mlp] * 6
        assert all(c.attends for c in measured)


def test_a_peft_wrapped_layer_costs_what_its_backbone_layer_does():
    # The LoRA wrappers, their matrices and a `modules_to_save` wrapper with its trained copy were counted as well
    # (down_proj three times).
    from peft import LoraConfig, get_peft_model

    from vlm_retrofit.skipping.accounting import weight_flops

    model, _ = tiny_vlm("llama")
    text = model.config
    plain = [weight_flops(layer, text) for layer in resolve(model).get_layers(model)]
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["down_proj"]))
    assert [weight_flops(layer, text) for layer in resolve(wrapped).get_layers(wrapped)] == plain


def test_a_mixture_without_an_intermediate_size_counts_the_width_a_token_runs():
    from types import SimpleNamespace

    dims = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    moe = SimpleNamespace(**dims, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48)
    assert LayerCost.from_config(moe).intermediate_size == 2 * 32 + 48
    assert LayerCost.from_config(SimpleNamespace(**dims, intermediate_size=128)).intermediate_size == 128
    undeclared = LayerCost.from_config(SimpleNamespace(**dims))
    with pytest.raises(ValueError, match="declares no MLP width.*from their weights"):
        undeclared.dense
    assert replace(undeclared, dense_flops=1000).full(batch=2, new_tokens=1, kv_length=1) == 2 * (1000 + 2 * 2 * 64)
