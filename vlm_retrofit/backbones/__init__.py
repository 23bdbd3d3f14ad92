"""Backbone specs: a registry keyed by HF `model_type`, and the families supported out of the box."""

from .registry import (
    PLUGIN_GROUP,
    AttentionParts,
    BackboneSpec,
    UnsupportedBackboneError,
    base_fingerprint,
    differing_weights,
    image_positions,
    layer_hidden_states,
    lora_layers,
    model_type_of,
    register_backbone,
    resolve,
    spec_for,
    supported_model_types,
    unregister_backbone,
    unchanged_fingerprint,
    unwrap_model,
    with_layer_hidden_states,
)
from . import families  # noqa: F401  (registers the built-in families)

__all__ = [
    "PLUGIN_GROUP",
    "AttentionParts",
    "BackboneSpec",
    "UnsupportedBackboneError",
    "base_fingerprint",
    "differing_weights",
    "image_positions",
    "layer_hidden_states",
    "lora_layers",
    "model_type_of",
    "register_backbone",
    "resolve",
    "spec_for",
    "supported_model_types",
    "unregister_backbone",
    "unchanged_fingerprint",
    "unwrap_model",
    "with_layer_hidden_states",
]
