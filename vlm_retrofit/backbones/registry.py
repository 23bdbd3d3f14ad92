"""Backbone registry: how to reach the decoder parts of each supported model family, keyed by `model_type`."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from ..errors import InputError


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the Hugging Face model inside a `peft` wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """PEFT tuner layers of `model` (empty without peft or without a LoRA)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # peft is optional for router-only training
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _default_decoder(model: nn.Module) -> nn.Module:
    return model.get_decoder()


def _default_lm_head(model: nn.Module) -> nn.Module:
    return model.get_output_embeddings()


def _default_text_config(config: Any) -> Any:
    return config.get_text_config()


def _no_layers(config: Any) -> Sequence[int]:
    return ()


def _default_uses_rotary(attention: nn.Module) -> bool:
    # SmolLM3, Llama 4 and Mistral Large 4 set `use_rope` per layer (their `no_rope_layers`).
    return bool(getattr(attention, "use_rope", True))


def no_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """The rotary function of an attention that rotates no keys (`BackboneSpec.uses_rotary` False): the identity."""
    return q, k


# Names under which attention modules keep a per-head key norm: one found where the spec names another is refused,
# since a skipped layer would otherwise write unnormalised keys.
KEY_NORM_NAMES = ("k_norm", "k_layernorm", "key_norm", "key_layernorm", "k_ln", "qk_norm")


# Config attributes under which the families keep the ids of placeholder tokens that carry visual features.
IMAGE_TOKEN_ATTRS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def _default_image_token_ids(config: Any) -> frozenset[int]:
    ids = set()
    for attr in IMAGE_TOKEN_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value >= 0:
            ids.add(value)
    return frozenset(ids)


def image_positions(input_ids: Any, image_ids: Tensor) -> Tensor | None:
    """Bool [B, T] of the visual-placeholder positions in `input_ids` (`image_ids`: Long [n], from a spec's
    `image_token_ids`); None when it holds none or is not a tensor, so text-only calls and decode steps carry no mask."""
    if not isinstance(input_ids, Tensor) or not image_ids.numel():
        return None
    is_image = torch.isin(input_ids, image_ids.to(input_ids.device))
    return is_image if bool(is_image.any()) else None


class KVPathError(TypeError):
    """A layer the kv-only cache path of a skipped layer cannot run: a layout it does not take, or a part the spec
    names wrongly. The message says which, and what to register instead where anything can be."""


class AttentionParts(NamedTuple):
    """The pieces of one decoder layer that the kv-only cache path runs for a skipped token."""

    input_norm: nn.Module
    attention: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    k_norm: nn.Module | None
    rotary_fn: Callable
    k_norm_over_projection: bool = False
    """Whether the key norm normalises the whole key projection (OLMoE) rather than each head (Qwen3)."""


_OF_CONFIG = ("text_config", "never_skip_layers", "feature_injection_layers", "image_token_ids")
"""BackboneSpec fields that are functions of the model's config."""


@dataclass(frozen=True)
class BackboneSpec:
    """Where routing and skipping find things in one model family.

    The defaults fit every decoder that follows the Llama layout (`get_decoder()` with `.layers`, `.norm`,
    `.embed_tokens`; layers with `input_layernorm` and `self_attn.{k_proj,v_proj[,k_norm]}`), so a
    standard family registers `BackboneSpec()` and a family that differs overrides only what differs.
    """

    decoder: Callable[[nn.Module], nn.Module] = _default_decoder
    """Maps the (unwrapped) top-level model to its language decoder."""
    layers_attr: str = "layers"
    """Attribute of the decoder holding the `nn.ModuleList` of decoder layers."""
    final_norm_attr: str = "norm"
    """Attribute of the decoder holding the norm applied after the last layer."""
    embed_tokens_attr: str = "embed_tokens"
    """Attribute of the decoder holding the token embedding."""
    lm_head: Callable[[nn.Module], nn.Module] = _default_lm_head
    """Maps the top-level model to its output projection."""
    input_norm_attr: str = "input_layernorm"
    """Attribute of a decoder layer holding the norm in front of attention."""
    attention_attr: str = "self_attn"
    """Attribute of a decoder layer holding the self-attention module."""
    k_proj_attr: str = "k_proj"
    v_proj_attr: str = "v_proj"
    k_norm_attr: str | None = "k_norm"
    """Per-head key norm (Qwen3, Gemma3); ignored where the attention module has none."""
    rotary_fn: Callable | None = None
    """`apply_rotary_pos_emb(q, k, cos, sin)`; None = the one in the attention class's modeling module."""
    uses_rotary: Callable[[nn.Module], bool] = _default_uses_rotary
    """Whether a layer's attention module rotates its keys (default: its `use_rope`, else True). Families with
    layers that do not (Cohere 2's full-attention layers: `lambda attention: attention.sliding_window is not None`)
    say so here; a skipped layer then writes its keys unrotated, as the layer itself does."""
    text_config: Callable[[Any], Any] = _default_text_config
    """Maps the top-level config to the language model's config."""
    never_skip_layers: Callable[[Any], Sequence[int]] = _no_layers
    """Layers that always run because a skipped token could not run them (a hybrid's layers without attention keep
    a recurrent state, not keys and values, so they have no kv-only path). Pruning removes layers around them and
    renumbers them."""
    feature_injection_layers: Callable[[Any], Sequence[int]] = _no_layers
    """Layers after which the backbone adds features to the stream by layer index (Qwen3-VL's deepstack visual
    features). They never skip, and a pruned release may delete no layer at or before the last of them: the kept
    layers would be renumbered and the features land elsewhere."""
    image_token_ids: Callable[[Any], frozenset[int]] = _default_image_token_ids
    """Input ids that are placeholders for visual features."""
    mlp_attr: str | None = "mlp"
    """Attribute of a decoder layer holding its MLP, which must be position-wise (each token's output depends on that
    token's input alone, as dense MLPs and token-routed mixtures of experts are): a block some tokens skip runs it on
    the other tokens only. None runs it over every token, the skipping ones' outputs discarded."""
    mlp_output_attr: str | None = "mlp.down_proj"
    """Dotted path, within a decoder layer, of the linear layer whose output is added to the stream unchanged as
    the MLP update (where a linear replacement of removed layers is folded); None where a norm follows it."""

    def __post_init__(self) -> None:
        # A value where a function belongs ("model", (0, 1), {90}) failed only later, as "'tuple' object is not
        # callable" from deep inside routing.
        for name in ("decoder", "lm_head", "uses_rotary", "text_config", "never_skip_layers", "feature_injection_layers",
                     "image_token_ids"):
            value = getattr(self, name)
            if not callable(value):
                of = "the config" if name in _OF_CONFIG else "the model or module"
                example = f": e.g. {name}=lambda config: {value!r}" if name in _OF_CONFIG else ""
                raise TypeError(f"BackboneSpec({name}=...) takes a function of {of}, got {type(value).__name__} "
                                f"{value!r}{example}")
        if self.rotary_fn is not None and not callable(self.rotary_fn):
            raise TypeError(f"BackboneSpec(rotary_fn=...) takes apply_rotary_pos_emb(q, k, cos, sin) or None, got "
                            f"{type(self.rotary_fn).__name__}")
        for name in ("layers_attr", "final_norm_attr", "embed_tokens_attr", "input_norm_attr", "attention_attr",
                     "k_proj_attr", "v_proj_attr", "k_norm_attr", "mlp_attr", "mlp_output_attr"):
            value = getattr(self, name)
            optional = name in ("k_norm_attr", "mlp_attr", "mlp_output_attr")
            if not (isinstance(value, str) or (value is None and optional)):
                raise TypeError(f"BackboneSpec({name}=...) takes an attribute name (a str), got {type(value).__name__}")

    # -- accessors -------------------------------------------------------------------------------------
    def get_decoder(self, model: nn.Module) -> nn.Module:
        return self.decoder(unwrap_model(model))

    def get_layers(self, model: nn.Module) -> nn.ModuleList:
        return _decoder_part(self.get_decoder(model), self.layers_attr, "layers_attr", "the decoder layers")

    def get_final_norm(self, model: nn.Module) -> nn.Module:
        return _decoder_part(self.get_decoder(model), self.final_norm_attr, "final_norm_attr", "the final norm")

    def get_embed_tokens(self, model: nn.Module) -> nn.Module:
        return _decoder_part(self.get_decoder(model), self.embed_tokens_attr, "embed_tokens_attr",
                             "the token embeddings")

    def get_lm_head(self, model: nn.Module) -> nn.Module:
        return self.lm_head(unwrap_model(model))

    def get_text_config(self, model: nn.Module) -> Any:
        return self.text_config(unwrap_model(model).config)

    def always_run_layers(self, config: Any) -> tuple[int, ...]:
        """The layers that never skip on a model of top-level `config`, ascending: `never_skip_layers` and
        `feature_injection_layers` together."""
        return tuple(sorted({*self.never_skip_layers(config), *self.feature_injection_layers(config)}))

    def attention_parts(self, layer: nn.Module) -> AttentionParts:
        attention = _kv_part(layer, self.attention_attr, "attention_attr", "the self-attention module")
        k_norm = getattr(attention, self.k_norm_attr, None) if self.k_norm_attr else None
        if k_norm is None and self.k_norm_attr:
            other = next((n for n in KEY_NORM_NAMES if isinstance(getattr(attention, n, None), nn.Module)), None)
            if other:
                raise KVPathError(f"{type(attention).__name__} has {other!r}, which looks like a per-head key norm, "
                                  f"and no {self.k_norm_attr!r}, the one the spec names: a skipped layer would write "
                                  f"unnormalised keys. Register the family with BackboneSpec(k_norm_attr={other!r}), "
                                  "or k_norm_attr=None if it is not one the keys pass through")
        if not self.uses_rotary(attention):
            rotary_fn = no_rotary
        else:
            rotary_fn = self.rotary_fn
        partial = _partial_rotary_factor(getattr(attention, "config", None))
        if rotary_fn is None and partial < 1:
            # Where the modeling module's apply_rotary_pos_emb rotates whole heads, its attention splits them first
            # (StableLM); some rotate the part themselves (GLM-4.1V): which is which shows only by reading them.
            raise KVPathError(f"{type(attention).__name__} rotates a part of each key (partial_rotary_factor {partial}), "
                              "and a skipped layer writes its K/V through the spec's rotary_fn: register the family "
                              "with BackboneSpec(rotary_fn=...) that rotates that part only (the modeling module's "
                              "apply_rotary_pos_emb where it does so itself, as GLM-4.1V's)")
        if rotary_fn is None:
            rotary_fn = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
            if rotary_fn is None:
                raise KVPathError(
                    f"{type(attention).__name__} has no module-level apply_rotary_pos_emb; "
                    "register its backbone with BackboneSpec(rotary_fn=...)"
                )
        clip = getattr(getattr(attention, "config", None), "clip_qkv", None)
        if clip is not None:
            raise KVPathError(f"{type(attention).__name__} clamps its projections (clip_qkv {clip}), which a skipped "
                              "layer's kv-only cache path does not: this family cannot skip blocks with that setting")
        k_proj = _kv_part(attention, self.k_proj_attr, "k_proj_attr", "the key projection")
        return AttentionParts(
            input_norm=_kv_part(layer, self.input_norm_attr, "input_norm_attr", "the norm in front of attention"),
            attention=attention,
            k_proj=k_proj,
            v_proj=_kv_part(attention, self.v_proj_attr, "v_proj_attr", "the value projection"),
            k_norm=k_norm,
            rotary_fn=rotary_fn,
            k_norm_over_projection=_norms_whole_projection(k_norm, k_proj, attention),
        )


def _norms_whole_projection(k_norm: nn.Module | None, k_proj: nn.Module, attention: nn.Module) -> bool:
    """Whether `k_norm` takes the whole key projection (its gain as wide as `k_proj`'s output, not a head)."""
    width = getattr(getattr(k_norm, "weight", None), "shape", None)
    head_dim = getattr(attention, "head_dim", None)
    return bool(width) and width[-1] != head_dim and width[-1] == getattr(k_proj, "out_features", None)


def _partial_rotary_factor(config: Any) -> float:
    """The share of each head that rotary embeddings rotate (1: all), wherever the config keeps it (its own attribute,
    or `rope_parameters`, per layer type in some families)."""
    found = [getattr(config, "partial_rotary_factor", None)]
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        found += [rope.get("partial_rotary_factor")]
        found += [value.get("partial_rotary_factor") for value in rope.values() if isinstance(value, dict)]
    return min((float(f) for f in found if f is not None), default=1.0)


def _decoder_part(decoder: nn.Module, attribute: str, spec_field: str, what: str) -> Any:
    """`decoder.<attribute>`, or an error naming the BackboneSpec field (or the decoder itself) to fix."""
    part = getattr(decoder, attribute, None)
    if part is not None:
        return part
    children = ", ".join(name for name, _ in decoder.named_children())
    raise TypeError(f"the decoder the spec found ({type(decoder).__name__}, with {children or 'no submodules'}) has no "
                    f"{attribute!r} ({what}): name it with BackboneSpec({spec_field}=...), or, if that is not the "
                    "language decoder (HF's get_decoder() returns the whole model in some families), point "
                    "BackboneSpec(decoder=...) at it")


def _kv_part(owner: nn.Module, attribute: str, spec_field: str, what: str) -> nn.Module:
    """`owner.<attribute>`, or an error saying which BackboneSpec field names it."""
    part = getattr(owner, attribute, None)
    if part is not None:
        return part
    fused = next((name for name in ("qkv_proj", "query_key_value", "c_attn", "Wqkv") if hasattr(owner, name)), None)
    if fused:
        raise KVPathError(f"{type(owner).__name__} projects queries, keys and values together ({fused!r}); the kv-only "
                          "cache path of a skipped layer needs separate key and value projections, so this family "
                          "cannot skip blocks")
    raise KVPathError(f"{type(owner).__name__} has no {attribute!r} ({what}), which a skipped layer runs to write its "
                      f"K/V into the cache: register the family with BackboneSpec({spec_field}=...) naming it. "
                      "Layouts without a separate norm, key and value projection (post-norm layers, fused qkv "
                      "projections) are not supported")


_REGISTRY: dict[str, BackboneSpec] = {}


def register_backbone(model_type: str, spec: BackboneSpec, *, overwrite: bool = False) -> BackboneSpec:
    """Make a model family (keyed by its HF `config.model_type`) usable with routers and skipping."""
    if not isinstance(spec, BackboneSpec):
        raise TypeError(f"register_backbone({model_type!r}, ...) needs a BackboneSpec, got {type(spec).__name__}")
    if not isinstance(model_type, str):
        raise TypeError(f"register_backbone keys families by their config's model_type, a str (e.g. "
                        f"{getattr(model_type, 'model_type', 'my_vlm')!r}), got {type(model_type).__name__}")
    if model_type in _REGISTRY and not overwrite:
        raise ValueError(f"backbone {model_type!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[model_type] = spec
    return spec


PLUGIN_GROUP = "vlm_retrofit.backbones"
"""Entry-point group of installed packages that register backbone families: each entry point names a module (its
import registers) or a function (called with no arguments), loaded once, when a family is not found. This is how
a family of your own reaches `python -m vlm_retrofit` and every process that loads its adapters and releases."""

_plugins_loaded = False
_plugin_failures: list[str] = []


class UnsupportedBackboneError(InputError):
    """A model family without a registered `BackboneSpec`."""


def load_plugins() -> None:
    """Load the `PLUGIN_GROUP` entry points of the installed packages (once per process)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for entry in entry_points(group=PLUGIN_GROUP):  # every one: a broken plug-in does not hide the others
        try:
            loaded = entry.load()
            if callable(loaded):
                loaded()
        except Exception as error:
            _plugin_failures.append(f"the backbone plug-in {entry.name!r} ({entry.value}, entry point group "
                                    f"{PLUGIN_GROUP!r}) failed to load: {type(error).__name__}: {error}")


def supported_model_types() -> list[str]:
    """The `model_type`s with a registered spec (installed plug-ins included), sorted."""
    load_plugins()
    return sorted(_REGISTRY)


def model_type_of(model: nn.Module) -> str:
    return unwrap_model(model).config.model_type


def spec_for(model_type: str) -> BackboneSpec:
    """The spec registered for `model_type` (installed plug-ins included); refuses unknown families clearly."""
    spec = _REGISTRY.get(model_type)
    if spec is None:
        load_plugins()
        spec = _REGISTRY.get(model_type)
    if spec is None:
        # A broken plug-in is named, not mistaken for a missing family (it may be the one that registers it).
        failures = f" {'; '.join(_plugin_failures)}." if _plugin_failures else ""
        raise UnsupportedBackboneError(
            f"model_type {model_type!r} is not a supported backbone. Supported: {', '.join(supported_model_types())}. "
            "To add a family, call vlm_retrofit.backbones.register_backbone(model_type, BackboneSpec(...)) in the "
            f"process, or from an installed package's {PLUGIN_GROUP!r} entry point for the command line "
            f"(see docs/backbones.md).{failures}"
        )
    return spec


def resolve(model: nn.Module) -> BackboneSpec:
    """The spec for `model` (a HF model or a `peft` wrapper of one); refuses unknown families clearly."""
    return spec_for(model_type_of(model))


# Keys of a text config that describe how a model is run or saved, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation",
    "_attn_implementation_autoset", "_commit_hash", "tie_word_embeddings", "pad_token_id",
    "bos_token_id", "eos_token_id",
})


WEIGHT_SAMPLES = 16
"""Values read from each fingerprinted tensor, evenly spaced through it."""


def _fingerprinted_tensors(spec: BackboneSpec, model: nn.Module) -> dict[str, Tensor]:
    """Language-model tensors routers and the usual LoRA targets (projections) leave alone: the token embeddings,
    the first and last layers' input norms, the final norm and an untied output head (a merge that changes one
    of them records the rest: `unchanged_fingerprint`)."""
    layers = spec.get_layers(model)
    modules = {"embed_tokens": spec.get_embed_tokens(model), "final_norm": spec.get_final_norm(model),
               "first_input_norm": getattr(layers[0], spec.input_norm_attr, None),
               "last_input_norm": getattr(layers[-1], spec.input_norm_attr, None), "lm_head": spec.get_lm_head(model)}
    weights = {}
    for name, module in modules.items():
        # PEFT's wrappers (modules_to_save, trainable tokens) answer `.weight` with the trained copy: the base's is
        # the original module's.
        original = getattr(module, "original_module", None)
        module = module if original is None else original
        weight = getattr(module, "weight", None)
        if isinstance(weight, Tensor) and not weight.is_meta and weight.numel() and not any(
                weight is other for other in weights.values()):  # a tied head is the embeddings
            weights[name] = weight
    return weights


def _projection_tensors(spec: BackboneSpec, model: nn.Module) -> dict[str, Tensor]:
    """The first and last layers' key and value projections (layers no schedule removes or skips): what tells
    apart two fine-tunes of one base that differ only there (a merged LoRA). Read where the model is known to be
    the plain base (`check_fingerprint(projections=True)`), since merging one's own LoRA changes them too."""
    layers, weights = spec.get_layers(model), {}
    for position, layer in (("first", layers[0]), ("last", layers[-1])):
        attention = getattr(layer, spec.attention_attr, None)
        for part in (spec.k_proj_attr, spec.v_proj_attr):
            weight = getattr(getattr(attention, part, None), "weight", None)  # PEFT's LoRA layers answer the base's
            if isinstance(weight, Tensor) and not weight.is_meta and weight.numel():
                weights[f"{position}_{part}"] = weight
    return weights


def evenly_spaced(numel: int, count: int) -> Tensor:
    """`count` indices from 0 to `numel - 1` inclusive, in integers (a float32 linspace rounds past the end of a
    tensor of more than 2^24 elements)."""
    return torch.arange(count, dtype=torch.int64) * (numel - 1) // max(1, count - 1)


def weight_samples(model: nn.Module, projections: bool = False) -> dict[str, list[float]]:
    """`WEIGHT_SAMPLES` values of each `_fingerprinted_tensors` tensor (`_projection_tensors` with `projections`),
    rounded to bfloat16: the same for a base loaded in float32, bfloat16 or float16, and different for another
    checkpoint of the same architecture."""
    samples = {}
    tensors = (_projection_tensors if projections else _fingerprinted_tensors)(resolve(model), model)
    for name, weight in tensors.items():
        flat = weight.detach().reshape(-1)
        index = evenly_spaced(flat.numel(), WEIGHT_SAMPLES).to(flat.device)
        samples[name] = flat[index].to(torch.bfloat16).float().cpu().tolist()
    return samples


def differing_weights(saved: dict[str, list[float]], actual: dict[str, list[float]]) -> list[str]:
    """The tensors both fingerprints read whose values differ by more than one bfloat16 step (a float16 load of
    bfloat16 weights rounds twice; below float16's normal range, by more than its smallest step)."""
    differing = []
    for name in sorted(set(saved) & set(actual)):
        a, b = torch.tensor(saved[name]), torch.tensor(actual[name])
        if a.shape != b.shape or bool(((a - b).abs() > 2 ** -7 * torch.maximum(a.abs(), b.abs()) + 2 ** -24).any()):
            differing.append(name)
    return differing


def unchanged_fingerprint(fingerprint: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`fingerprint` without the weight samples `model` no longer matches: what a release whose weights were merged
    into (a LoRA on the head or the embeddings) can still be checked by."""
    unchanged = dict(fingerprint)
    for key, projections in (("weight_samples", False), ("projection_samples", True)):
        samples = fingerprint.get(key)
        if samples:
            changed = set(differing_weights(samples, weight_samples(model, projections)))
            unchanged[key] = {k: v for k, v in samples.items() if k not in changed}
    return unchanged


def base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """What identifies the base an adapter belongs to: family, depth, width, a hash of the text config, and
    values sampled from its weights (`weight_samples`: two checkpoints of one architecture differ there)."""
    spec = resolve(model)
    text_config = spec.get_text_config(model)
    config_dict = {k: v for k, v in text_config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    canonical = json.dumps(config_dict, sort_keys=True, default=str)
    return {
        "model_type": model_type_of(model),
        "num_layers": len(spec.get_layers(model)),
        "hidden_size": int(text_config.hidden_size),
        "text_config_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
        "weight_samples": weight_samples(model),
        "projection_samples": weight_samples(model, projections=True),
    }


def unregister_backbone(model_type: str) -> BackboneSpec:
    """Remove a registered family (for tests and plug-ins that register temporarily)."""
    try:
        return _REGISTRY.pop(model_type)
    except KeyError:
        raise ValueError(f"backbone {model_type!r} is not registered; registered: {supported_model_types()}") from None


def layer_hidden_states(args: tuple, kwargs: dict[str, Any]) -> Tensor:
    """The hidden states a decoder layer is called with (positional first argument, or the `hidden_states`
    keyword: families and transformers versions differ), as a forward pre-hook sees them."""
    return args[0] if args else kwargs["hidden_states"]


def layer_output(output: Any) -> Tensor:
    """The hidden states a decoder layer returns (a tensor, or the first item of a tuple: older transformers, and a
    mixture of experts adding its router logits), as a forward hook sees them."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_layer_hidden_states(args: tuple, kwargs: dict[str, Any], hidden: Tensor) -> tuple[tuple, dict[str, Any]]:
    """A decoder layer's call arguments with `hidden` in place of its hidden states (a forward pre-hook's return)."""
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}
