"""The supported model families: one registry entry each."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Sequence

from .registry import BackboneSpec, register_backbone

STANDARD = BackboneSpec()
"""Llama-layout decoders; M-RoPE families fold their 3-D positions into cos/sin before the layers."""


def _qwen3_vl_deepstack_layers(config: Any) -> Sequence[int]:
    # Qwen3-VL adds deepstack visual features to the stream after each of its first layers.
    return tuple(range(len(config.vision_config.deepstack_visual_indexes or ())))


def _layers_of_type(layer_type: str):
    """`never_skip_layers` of the layers whose `layer_types` entry is `layer_type`: a hybrid family's layers without
    attention (LFM2's short convolutions, Qwen3.5's Gated DeltaNet) keep a recurrent state in the cache, not keys and
    values, so there is no kv-only path for a skipped token: they always run."""

    def layers(config: Any) -> Sequence[int]:
        return tuple(i for i, kind in enumerate(config.get_text_config().layer_types) if kind == layer_type)

    return layers


def _own_rotary(module: str):
    """`rotary_fn` calling the `apply_rotary_pos_emb` of `transformers.models.<module>`, for families that rotate a
    part of each head themselves. Imported when a layer skips, so that registering the family does not load its
    modeling module."""

    @functools.cache
    def apply_rotary_pos_emb() -> Any:  # looked up once, at the first skipped layer
        return importlib.import_module(f"transformers.models.{module}").apply_rotary_pos_emb

    def rotary(q, k, cos, sin, *args: Any, **kwargs: Any):
        return apply_rotary_pos_emb()(q, k, cos, sin, *args, **kwargs)

    rotary.__qualname__ = f"{module}.apply_rotary_pos_emb"  # what a consistency report names
    return rotary


STANDARD_FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "llava",
    "llava_onevision",
    "idefics3",
    "smolvlm",
    "paligemma",
    "internvl",
    "mistral3",
    "llava_next",
    "perception_lm",
    "llama",
    "qwen2",
)

for _model_type in STANDARD_FAMILIES:
    register_backbone(_model_type, STANDARD)
register_backbone("qwen3_vl", BackboneSpec(feature_injection_layers=_qwen3_vl_deepstack_layers))
# Qwen3-VL-MoE: Qwen3-VL's deepstack with a mixture of experts as each layer's MLP, whose experts keep their output
# projections stacked in one parameter (`mlp.experts.down_proj`) and add their outputs weighted per token: there is
# no single linear layer to fold a replacement into.
register_backbone("qwen3_vl_moe", BackboneSpec(feature_injection_layers=_qwen3_vl_deepstack_layers,
                                              mlp_output_attr=None))
# Gemma 3 normalises the MLP output (post_feedforward_layernorm) before adding it to the stream.
register_backbone("gemma3", BackboneSpec(mlp_output_attr=None))
# Cohere 2 text (Aya Vision, Command A Vision): each layer adds attention and MLP, both fed by `input_layernorm`, to
# the stream in parallel (the kv-only path needs only that norm, and `mlp.down_proj` still adds its output unchanged);
# only its sliding-window layers rotate keys, the full-attention ones use no position encoding at all.
COHERE2_TEXT = BackboneSpec(uses_rotary=lambda attention: attention.sliding_window is not None)
register_backbone("aya_vision", COHERE2_TEXT)
# Command A Vision: the same Cohere 2 text behind a SigLIP tower.
register_backbone("cohere2_vision", COHERE2_TEXT)
# GLM-4.1V's GLM-4 text normalises the attention and the MLP outputs (post_self_attn_layernorm, post_mlp_layernorm)
# before adding them to the stream, and rotates only part of each head (partial_rotary_factor 0.5), which its own
# apply_rotary_pos_emb does (the first cos.shape[-1] channels, pairing adjacent ones); the kv-only path is refused
# until the spec names such a function.
register_backbone("glm4v", BackboneSpec(rotary_fn=_own_rotary("glm4v.modeling_glm4v"), mlp_output_attr=None))
# LFM2-VL's LFM2 text: each layer runs a short gated convolution (its state in the hybrid cache) or GQA attention after
# `operator_norm`, then `feed_forward` (the MLP; w2 adds its output unchanged) after `ffn_norm`; the attention
# normalises each key head (`k_layernorm`), and the decoder's final norm is called `embedding_norm`. The convolution
# layers never skip.
register_backbone("lfm2_vl", BackboneSpec(final_norm_attr="embedding_norm", input_norm_attr="operator_norm",
                                          k_norm_attr="k_layernorm", never_skip_layers=_layers_of_type("conv"),
                                          mlp_attr="feed_forward", mlp_output_attr="feed_forward.w2"))
# Qwen3.5: three Gated DeltaNet layers (linear attention, `linear_attn`) to one full-attention layer, which gates
# its output per channel (each head's slice of q_proj is twice head_dim: query, then gate) and rotates the first
# quarter of each head after a per-head key norm, as its own apply_rotary_pos_emb does. The linear-attention layers
# never skip.
QWEN3_5_TEXT = BackboneSpec(rotary_fn=_own_rotary("qwen3_5.modeling_qwen3_5"),
                            never_skip_layers=_layers_of_type("linear_attention"))
register_backbone("qwen3_5", QWEN3_5_TEXT)
# Qwen3.5-MoE: the same layers (the same rotary) with a mixture of experts and a shared expert as each MLP: no
# single linear layer adds the MLP's output to the stream.
register_backbone("qwen3_5_moe", dataclasses.replace(QWEN3_5_TEXT, mlp_output_attr=None))
