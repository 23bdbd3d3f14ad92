"""The supported model families: one registry entry each."""

from __future__ import annotations

from typing import Any, Sequence

from .registry import BackboneSpec, register_backbone

STANDARD = BackboneSpec()
"""Llama-layout decoders; M-RoPE families fold their 3-D positions into cos/sin before the layers."""


def _qwen3_vl_deepstack_layers(config: Any) -> Sequence[int]:
    # Qwen3-VL adds deepstack visual features to the stream after each of its first layers.
    return tuple(range(len(config.vision_config.deepstack_visual_indexes or ())))


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
    "llama",
    "qwen2",
)

for _model_type in STANDARD_FAMILIES:
    register_backbone(_model_type, STANDARD)
register_backbone("qwen3_vl", BackboneSpec(never_skip_layers=_qwen3_vl_deepstack_layers))
# Gemma 3 normalises the MLP output (post_feedforward_layernorm) before adding it to the stream.
register_backbone("gemma3", BackboneSpec(mlp_output_attr=None))
# Aya Vision's Cohere 2 text: each layer adds attention and MLP, both fed by `input_layernorm`, to the stream in
# parallel (the kv-only path needs only that norm, and `mlp.down_proj` still adds its output unchanged); only its
# sliding-window layers rotate keys, the full-attention ones use no position encoding at all.
register_backbone("aya_vision", BackboneSpec(uses_rotary=lambda attention: attention.sliding_window is not None))
