"""Tiny, offline, deterministic Hugging Face VLMs (and text LMs) for testing router plug-ins."""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import transformers as tf
from PIL import Image

from .errors import InputError

__all__ = ["FAMILIES", "tiny_vlm", "tiny_inputs"]


class UnknownOverrideError(InputError, TypeError):
    """A `tiny_vlm` override its text config does not define."""

FAMILIES: tuple[str, ...] = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "llava_onevision",
    "idefics3",
    "smolvlm",
    "paligemma",
    "gemma3",
    "internvl",
    "mistral3",
    "llava_next",
    "aya_vision",
    "cohere2_vision",
    "qwen3_vl_moe",
    "glm4v",
    "lfm2_vl",
    "perception_lm",
    "qwen3_5",
    "qwen3_5_moe",
    "llama",
    "qwen2",
)

_SEED = 1234
_IMAGE_PX = 56  # side of the images made by tiny_inputs
_ATTN = "eager"  # exact and supported by every family (Gemma3 prefers it too)

# Tiny text decoder shared by all families; `tiny_vlm(**overrides)` edits it.
_TEXT_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)
# Tiny ViT shared by the SigLIP/CLIP-like towers.
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small red ball rolls across the green grass.
What is in this picture? Describe the image in one short sentence. The picture shows a cat,
a dog, a bird and a tree. There is a blue sky with white clouds above the hills and the river.
Please answer the question briefly and clearly. How many apples are on the table? There are
three apples and two oranges. The man is reading a book while the woman is drinking tea.
Where is the red car? The car is parked next to the old house near the station. Colours such
as red, green, blue, yellow, black and white appear in many photos. Count the shapes: one
circle, two squares and three triangles. Is it day or night? It is a bright sunny morning.
The assistant looks at the image and the user asks a question about what it can see.
"""

_PROMPTS = (
    "Describe the image.",
    "What colour is the large shape in this picture?",
    "How many shapes can you count, and where is the red one placed?",
    "Is it day or night in the picture? Please answer the question briefly and clearly.",
)


# --------------------------------------------------------------------------- chat templates
def _chat_template(turn: str, end: str, image: str, roles: dict[str, str] | None = None, bos: str = "") -> str:
    """Jinja chat template: `bos`, then per message `turn` (with ROLE) + content + `end`."""
    roles = roles or {}
    role = "{{ roles.get(message['role'], message['role']) }}"
    head = turn.replace("ROLE", role)
    gen = turn.replace("ROLE", roles.get("assistant", "assistant"))
    return (
        "{% set roles = " + repr(roles) + " %}"
        + bos
        + "{% for message in messages %}"
        + head
        + "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for c in message['content'] %}"
        "{% if c['type'] == 'image' %}" + image + "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        + end
        + "{% endfor %}"
        + "{% if add_generation_prompt %}" + gen + "{% endif %}"
    )


_CHATML = dict(turn="<|im_start|>ROLE\n", end="<|im_end|>\n")
_IM_START = ("<|im_start|>",)


# --------------------------------------------------------------------------- per-family specs
@dataclass(frozen=True)
class _Family:
    model_cls: str  # class name in `transformers`
    text_cfg: str  # text config class name in `transformers`
    tokens: dict[str, str]  # named special tokens -> tokenizer attributes (bos_token, image_token, ...)
    template: str  # chat template
    extra_tokens: tuple[str, ...] = ()  # further special tokens the processor looks up
    processor: Callable[[Any], Any] | None = None  # tokenizer -> processor (None: text-only)
    config: Callable[[Any, Any, Any], Any] | None = None  # (text_config, tokenizer, processor) -> config
    text_fix: Callable[[dict, dict], None] | None = None  # (text kwargs, overrides) -> None, edits in place


def _ids(tok, **names: str) -> dict[str, int]:
    return {k: tok.convert_tokens_to_ids(v) for k, v in names.items()}


def _mrope(interleaved: bool, partial: float = 1.0):
    """Text-config fix: M-RoPE sections (T, H, W) summing to half the rotated channels of a head (head_dim / 2, or
    less where only the first `partial` of each head is rotated)."""

    def fix(kw: dict, overrides: dict) -> None:
        if "rope_parameters" in overrides:
            return
        half = int(kw["head_dim"] * partial) // 2
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if partial < 1:
            rope["partial_rotary_factor"] = partial
        if interleaved:  # Qwen3-VL interleaves T/H/W: H and W each need 3 * section <= head_dim / 2
            rope.update(mrope_section=[half - 2 * (half // 4), half // 4, half // 4], mrope_interleaved=True)
        else:
            rope.update(mrope_section=[half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8])
        kw["rope_parameters"] = rope

    return fix


def _alternating_layers(kw: dict, overrides: dict) -> None:
    """Text-config fix: alternate sliding (window 16) / full attention layers, so that each kind has a layer
    between the first and the last (the skip-consistency check needs one of each that can skip)."""
    kw.setdefault("sliding_window", 16)
    kw.setdefault("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention"
                                  for i in range(kw["num_hidden_layers"])])


def _gemma3_text(kw: dict, overrides: dict) -> None:
    """Text-config fix: alternating sliding / full attention layers; query scale 1/sqrt(head_dim)."""
    _alternating_layers(kw, overrides)
    kw.setdefault("query_pre_attn_scalar", kw["head_dim"])


def _qwen3_moe_text(kw: dict, overrides: dict) -> None:
    """Text-config fix: interleaved M-RoPE; every layer's MLP is 4 tiny experts, 2 of them per token."""
    _mrope(True)(kw, overrides)
    kw.setdefault("num_experts", 4)
    kw.setdefault("num_experts_per_tok", 2)
    kw.setdefault("moe_intermediate_size", 32)


def _lfm2_text(kw: dict, overrides: dict) -> None:
    """Text-config fix: a short-convolution layer second in every six, GQA attention in the others (so a 6-layer
    model's layers 2-5 can skip, be removed and take a q_proj / v_proj LoRA; the convolution layer never skips); the
    MLP as wide as asked (LFM2 would shrink it to 2/3 and round it up to a multiple of 256)."""
    kw.setdefault("layer_types", ["conv" if i % 6 == 1 else "full_attention" for i in range(kw["num_hidden_layers"])])
    kw.setdefault("block_auto_adjust_ff_dim", False)


def _qwen3_5_text(kw: dict, overrides: dict) -> None:
    """Text-config fix: interleaved M-RoPE over half of each head (Qwen3.5 rotates a quarter; half keeps every
    section non-empty at head_dim 16); a Gated DeltaNet layer (linear attention: a recurrent state in the hybrid
    cache) second in every six, full attention in the others, as `_lfm2_text` places its convolutions (a 6-layer
    model's layers 2-5 can skip; Qwen3.5 has three linear layers to one full); 2 tiny key heads and 4 value heads in
    the linear layers."""
    _mrope(True, partial=0.5)(kw, overrides)
    kw.setdefault("layer_types", ["linear_attention" if i % 6 == 1 else "full_attention"
                                  for i in range(kw["num_hidden_layers"])])
    kw.setdefault("linear_key_head_dim", 8)
    kw.setdefault("linear_value_head_dim", 8)
    kw.setdefault("linear_num_key_heads", 2)
    kw.setdefault("linear_num_value_heads", 4)


def _qwen3_5_moe_text(kw: dict, overrides: dict) -> None:
    """Text-config fix: `_qwen3_5_text`'s layers with a mixture of experts as every MLP: 4 tiny experts, 2 of them
    per token, beside a shared expert."""
    _qwen3_5_text(kw, overrides)
    kw.setdefault("num_experts", 4)
    kw.setdefault("num_experts_per_tok", 2)
    kw.setdefault("moe_intermediate_size", 32)
    kw.setdefault("shared_expert_intermediate_size", 32)


def _full_attention(kw: dict, overrides: dict) -> None:
    """Text-config fix: no sliding window (MistralConfig defaults to 4096; Mistral3Config's own default text
    config, Mistral Small 3.1's, has none)."""
    kw.setdefault("sliding_window", None)


_QWEN_TOKENS = dict(
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    image_token="<|image_pad|>",
    video_token="<|video_pad|>",
    vision_start_token="<|vision_start|>",
    vision_end_token="<|vision_end|>",
)
_QWEN_TEMPLATE = _chat_template(**_CHATML, image="<|vision_start|><|image_pad|><|vision_end|>")


def _qwen_processor(proc_cls: str, video_cls: str, patch: int):
    def build(tok):
        size = {"shortest_edge": (2 * patch) ** 2, "longest_edge": (4 * patch) ** 2}
        kw = dict(patch_size=patch, merge_size=2, temporal_patch_size=2, size=size)
        return getattr(tf, proc_cls)(
            image_processor=tf.Qwen2VLImageProcessor(**kw),
            tokenizer=tok,
            video_processor=getattr(tf, video_cls)(**kw),
            chat_template=tok.chat_template,
        )

    return build


def _qwen_config(cfg_cls: str, version: int):
    """Qwen2-VL (2), Qwen2.5-VL (25), Qwen3-VL (3) or Qwen3.5 (35: Qwen3-VL's tower without deepstack)."""
    def build(text, tok, proc):
        common = dict(depth=2, num_heads=2, patch_size=16 if version in (3, 35) else 14, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)
        if version == 2:
            vision = dict(common, embed_dim=32, hidden_size=text.hidden_size, mlp_ratio=2)
        elif version == 25:
            vision = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=text.hidden_size,
                          window_size=56, fullatt_block_indexes=[1])
        else:  # Qwen3-VL's deepstack taps vision layers 0 and 1 -> injected after decoder layers 0 and 1
            vision = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=text.hidden_size,
                          num_position_embeddings=64, **({"deepstack_visual_indexes": [0, 1]} if version == 3 else {}))
        ids = _ids(tok, image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                   vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>")
        return getattr(tf, cfg_cls)(text_config=text, vision_config=vision, **ids)

    return build


def _llava_processor(tok):
    ip = tf.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return tf.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                             num_additional_image_tokens=1, chat_template=tok.chat_template)


def _llava_config(text, tok, proc):
    vision = tf.CLIPVisionConfig(**_VISION, image_size=28, patch_size=14, projection_dim=32)
    return tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=proc.image_token_id,
                          image_seq_length=4, vision_feature_select_strategy="default", vision_feature_layer=-2)


_OV_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]


def _onevision_processor(tok):
    kw = dict(size={"height": 28, "width": 28}, image_grid_pinpoints=_OV_PINPOINTS)
    return tf.LlavaOnevisionProcessor(
        image_processor=tf.LlavaOnevisionImageProcessor(**kw), tokenizer=tok,
        video_processor=tf.LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28}),
        num_image_tokens=4, vision_feature_select_strategy="full", chat_template=tok.chat_template)


def _onevision_config(text, tok, proc):
    vision = tf.SiglipVisionConfig(**_VISION, image_size=28, patch_size=14)
    return tf.LlavaOnevisionConfig(vision_config=vision, text_config=text, image_grid_pinpoints=_OV_PINPOINTS,
                                   vision_feature_select_strategy="full", vision_feature_layer=-1,
                                   **_ids(tok, image_token_index="<image>", video_token_index="<video>"))


def _idefics_processor(proc_cls: str, ip_cls: str, video_cls: str | None):
    def build(tok):
        size = dict(size={"longest_edge": 56}, max_image_size={"longest_edge": 56}, do_image_splitting=False)
        kw = dict(image_processor=getattr(tf, ip_cls)(**size), tokenizer=tok, image_seq_len=4,
                  chat_template=tok.chat_template)
        if video_cls:
            kw["video_processor"] = getattr(tf, video_cls)(
                size={"longest_edge": 56}, max_image_size={"longest_edge": 56})
        return getattr(tf, proc_cls)(**kw)

    return build


def _idefics_config(cfg_cls: str, vision_cls: str):
    def build(text, tok, proc):
        vision = getattr(tf, vision_cls)(**_VISION, image_size=56, patch_size=14)
        return getattr(tf, cfg_cls)(vision_config=vision, text_config=text, scale_factor=2,
                                    image_token_id=proc.image_token_id, pad_token_id=tok.pad_token_id)

    return build


def _paligemma_processor(tok):
    ip = tf.SiglipImageProcessor(size={"height": 28, "width": 28})
    ip.image_seq_length = 4
    return tf.PaliGemmaProcessor(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template)


def _paligemma_config(text, tok, proc):
    vision = tf.SiglipVisionConfig(**_VISION, image_size=28, patch_size=14, projection_dim=text.hidden_size)
    return tf.PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=proc.image_token_id,
                              projection_dim=text.hidden_size, hidden_size=text.hidden_size,
                              vocab_size=text.vocab_size)


def _gemma3_processor(tok):
    ip = tf.Gemma3ImageProcessor(size={"height": 56, "width": 56}, do_pan_and_scan=False)
    return tf.Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=4, chat_template=tok.chat_template)


def _gemma3_config(text, tok, proc):
    vision = tf.SiglipVisionConfig(**_VISION, image_size=56, patch_size=14)
    return tf.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                           **_ids(tok, boi_token_index="<start_of_image>", eoi_token_index="<end_of_image>",
                                  image_token_index="<image_soft_token>"))


def _internvl_processor(tok):
    ip = tf.GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=False)
    vp = tf.InternVLVideoProcessor(size={"height": 56, "width": 56})
    return tf.InternVLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, image_seq_length=4,
                                chat_template=tok.chat_template)


def _internvl_config(text, tok, proc):
    vision = tf.InternVLVisionConfig(**_VISION, image_size=56, patch_size=14)
    return tf.InternVLConfig(vision_config=vision, text_config=text, image_token_id=proc.image_token_id,
                             image_seq_length=4, downsample_ratio=0.5)


def _mistral3_processor(tok):
    # Pixtral tiles images into (patch_size * spatial_merge_size)-px tokens: a 56 px image gives 2 x 2 [IMG]s.
    ip = tf.PixtralImageProcessor(size={"longest_edge": 56}, patch_size={"height": 14, "width": 14})
    return tf.PixtralProcessor(image_processor=ip, tokenizer=tok, patch_size=14, spatial_merge_size=2,
                               chat_template=tok.chat_template)


def _mistral3_config(text, tok, proc):
    vision = tf.PixtralVisionConfig(**_VISION, image_size=56, patch_size=14, head_dim=16)
    # Mistral Small 3.1 has its own output head; Mistral3Config's default would tie it to the embeddings.
    return tf.Mistral3Config(vision_config=vision, text_config=text, image_token_index=proc.image_token_id,
                             spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=False)


def _llava_next_processor(tok):
    ip = tf.LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                    image_grid_pinpoints=_OV_PINPOINTS)
    return tf.LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=14,
                                 vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                 chat_template=tok.chat_template)


def _llava_next_config(text, tok, proc):
    vision = tf.CLIPVisionConfig(**_VISION, image_size=28, patch_size=14, projection_dim=32)
    return tf.LlavaNextConfig(vision_config=vision, text_config=text, image_grid_pinpoints=_OV_PINPOINTS,
                              image_token_index=proc.image_token_id, image_seq_length=4,
                              vision_feature_select_strategy="default", vision_feature_layer=-2)


_AYA_IMAGE_TOKENS = ("<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>")


def _aya_processor(tok):
    # One 56 px tile per image (no crops): SigLIP's 4 x 4 patches, pixel-shuffled by 2, are 4 <|IMG_PATCH|>s.
    ip = tf.GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=False)
    return tf.AyaVisionProcessor(image_processor=ip, tokenizer=tok, patch_size=14, img_size=56, downsample_factor=2,
                                 chat_template=tok.chat_template)


def _aya_config(text, tok, proc):
    vision = tf.SiglipVisionConfig(**_VISION, image_size=56, patch_size=14, vision_use_head=False)
    return tf.AyaVisionConfig(vision_config=vision, text_config=text, image_token_index=proc.image_token_id,
                              downsample_factor=2, vision_feature_select_strategy="full", vision_feature_layer=-1)


def _cohere2_vision_processor(tok):
    # One 56 px tile per image (no crops): SigLIP's 4 x 4 patches, pixel-shuffled by 2, are 2 x 2 <|IMG_PATCH|>s (the
    # image processor's patch_size counts a tile's tokens per side), then one <|IMG_LINE_BREAK|>.
    ip = tf.Cohere2VisionImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=False, patch_size=2)
    return tf.Cohere2VisionProcessor(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template)


def _cohere2_vision_config(text, tok, proc):
    vision = tf.SiglipVisionConfig(**_VISION, image_size=56, patch_size=14, vision_use_head=False)
    return tf.Cohere2VisionConfig(vision_config=vision, text_config=text, image_token_id=proc.image_token_id,
                                  downsample_factor=2, alignment_intermediate_size=64)


def _glm4v_processor(tok):
    # Qwen2-VL-style flattened patches: a 56 px image is 4 x 4 patches of 14 px, merged 2 x 2 into 4 <|image|>s.
    kw = dict(patch_size=14, merge_size=2, temporal_patch_size=2,
              size={"shortest_edge": 2 * 28 * 28, "longest_edge": 2 * 56 * 56})  # pixels x 2 frames
    return tf.Glm4vProcessor(image_processor=tf.Glm4vImageProcessor(**kw), tokenizer=tok,
                             video_processor=tf.Glm4vVideoProcessor(**kw), chat_template=tok.chat_template)


def _glm4v_config(text, tok, proc):
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, image_size=56, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text.hidden_size)
    ids = _ids(tok, image_token_id="<|image|>", video_token_id="<|video|>", image_start_token_id="<|begin_of_image|>",
               image_end_token_id="<|end_of_image|>", video_start_token_id="<|begin_of_video|>",
               video_end_token_id="<|end_of_video|>")
    return tf.Glm4vConfig(text_config=text, vision_config=vision, **ids)


def _lfm2_vl_processor(tok):
    # One tile per image (no splitting), resized to a multiple of 28 px of at most 4 tokens: SigLIP 2's 4 x 4 patches
    # of 14 px of a 56 px image, unshuffled by 2, are 4 <image>s.
    ip = tf.Lfm2VlImageProcessor(encoder_patch_size=14, downsample_factor=2, min_image_tokens=1, max_image_tokens=4,
                                 do_image_splitting=False)
    return tf.Lfm2VlProcessor(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template)


def _lfm2_vl_config(text, tok, proc):
    vision = tf.Siglip2VisionConfig(**_VISION, patch_size=14, num_patches=16)
    return tf.Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=proc.image_token_id,
                           projector_hidden_size=text.hidden_size, downsample_factor=2)


def _perception_lm_processor(tok):
    # One 56 px tile per image ("vanilla": no thumbnail, no tiles): 4 x 4 patches of 14 px, pooled by 2 to 4 <|image|>s.
    ip = tf.PerceptionLMImageProcessor(vision_input_type="vanilla", tile_size=56, max_num_tiles=1,
                                       size={"height": 56, "width": 56})
    vp = tf.PerceptionLMVideoProcessor(size={"height": 56, "width": 56})
    return tf.PerceptionLMProcessor(video_processor=vp, image_processor=ip, tokenizer=tok, patch_size=14,
                                    pooling_ratio=2, chat_template=tok.chat_template)


def _perception_lm_config(text, tok, proc):
    # The Perception Encoder is a timm model (TimmWrapper), and timm is no dependency: a CLIP ViT, which also puts a
    # CLS token first, stands in; the projector reads the tower's width from `model_args` as it does timm's.
    vision = tf.CLIPVisionConfig(**_VISION, image_size=56, patch_size=14,
                                 model_args={"embed_dim": _VISION["hidden_size"]})
    return tf.PerceptionLMConfig(vision_config=vision, text_config=text, vision_use_cls_token=True,
                                 projector_pooling_ratio=2,
                                 **_ids(tok, image_token_id="<|image|>", video_token_id="<|video|>"))


# Mistral's "[INST]question[/INST]answer" turns; per message the helper can only prefix, so "[/INST]" opens answers.
_MISTRAL_TEMPLATE = dict(turn="ROLE", end="", roles={"user": "[INST]", "assistant": "[/INST]",
                                                     "system": "[SYSTEM_PROMPT]"}, bos="<s>")

_IDEFICS_TOKENS = dict(bos_token="<|begin_of_text|>", eos_token="<end_of_utterance>", pad_token="<|finetune_pad|>",
                       image_token="<image>", fake_image_token="<fake_token_around_image>",
                       global_image_token="<global-img>", end_of_utterance_token="<end_of_utterance>")
_IDEFICS_EXTRA = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
_IDEFICS_TEMPLATE = _chat_template("ROLE:", "<end_of_utterance>\n", "<image>",
                                   {"user": "User", "assistant": "Assistant", "system": "System"},
                                   bos="<|begin_of_text|>")

# family -> (model class, text config class, named special tokens, chat template, other special tokens, ...)
_SPECS: dict[str, _Family] = {
    "qwen2_vl": _Family(
        "Qwen2VLForConditionalGeneration", "Qwen2VLTextConfig", _QWEN_TOKENS, _QWEN_TEMPLATE, _IM_START,
        processor=_qwen_processor("Qwen2VLProcessor", "Qwen2VLVideoProcessor", 14),
        config=_qwen_config("Qwen2VLConfig", 2), text_fix=_mrope(False)),
    "qwen2_5_vl": _Family(
        "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLTextConfig", _QWEN_TOKENS, _QWEN_TEMPLATE, _IM_START,
        processor=_qwen_processor("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", 14),
        config=_qwen_config("Qwen2_5_VLConfig", 25), text_fix=_mrope(False)),
    "qwen3_vl": _Family(
        "Qwen3VLForConditionalGeneration", "Qwen3VLTextConfig", _QWEN_TOKENS, _QWEN_TEMPLATE, _IM_START,
        processor=_qwen_processor("Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16),
        config=_qwen_config("Qwen3VLConfig", 3), text_fix=_mrope(True)),
    "llava": _Family(
        "LlavaForConditionalGeneration", "LlamaConfig",
        dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", image_token="<image>"),
        _chat_template("ROLE: ", " ", "<image>\n", {"user": "USER", "assistant": "ASSISTANT", "system": "SYSTEM"},
                       bos="<s>"),
        processor=_llava_processor, config=_llava_config),
    "llava_onevision": _Family(
        "LlavaOnevisionForConditionalGeneration", "Qwen2Config",
        dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", image_token="<image>", video_token="<video>"),
        _chat_template(**_CHATML, image="<image>\n"), _IM_START,
        processor=_onevision_processor, config=_onevision_config),
    "idefics3": _Family(
        "Idefics3ForConditionalGeneration", "LlamaConfig", _IDEFICS_TOKENS, _IDEFICS_TEMPLATE, _IDEFICS_EXTRA,
        processor=_idefics_processor("Idefics3Processor", "Idefics3ImageProcessor", None),
        config=_idefics_config("Idefics3Config", "Idefics3VisionConfig")),
    "smolvlm": _Family(
        "SmolVLMForConditionalGeneration", "LlamaConfig", dict(_IDEFICS_TOKENS, video_token="<video>"),
        _IDEFICS_TEMPLATE, _IDEFICS_EXTRA,
        processor=_idefics_processor("SmolVLMProcessor", "SmolVLMImageProcessor", "SmolVLMVideoProcessor"),
        config=_idefics_config("SmolVLMConfig", "SmolVLMVisionConfig")),
    "paligemma": _Family(  # prompt "<image>...<image><bos>text\n"; the processor inserts <bos> and "\n"
        "PaliGemmaForConditionalGeneration", "GemmaConfig",
        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", image_token="<image>"),
        _chat_template("", "", "<image>"),
        processor=_paligemma_processor, config=_paligemma_config),
    "gemma3": _Family(
        "Gemma3ForConditionalGeneration", "Gemma3TextConfig",
        dict(bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>", image_token="<image_soft_token>",
             boi_token="<start_of_image>", eoi_token="<end_of_image>"),
        _chat_template("<start_of_turn>ROLE\n", "<end_of_turn>\n", "<start_of_image>", {"assistant": "model"},
                       bos="<bos>"), ("<eos>",),
        processor=_gemma3_processor, config=_gemma3_config, text_fix=_gemma3_text),
    "internvl": _Family(
        "InternVLForConditionalGeneration", "Qwen2Config",
        dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", start_image_token="<img>", end_image_token="</img>",
             context_image_token="<IMG_CONTEXT>", video_token="<video>"),
        _chat_template(**_CHATML, image="<IMG_CONTEXT>\n"), _IM_START,
        processor=_internvl_processor, config=_internvl_config),
    "mistral3": _Family(  # "<s>[INST][IMG]...[IMG_END]text[/INST]"
        "Mistral3ForConditionalGeneration", "MistralConfig",
        dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", image_token="[IMG]",
             image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]"),
        _chat_template(image="[IMG]", **_MISTRAL_TEMPLATE),
        processor=_mistral3_processor, config=_mistral3_config, text_fix=_full_attention),
    "llava_next": _Family(  # LLaVA-NeXT on Mistral: "<s>[INST]<image>\ntext[/INST]"
        "LlavaNextForConditionalGeneration", "MistralConfig",
        dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", image_token="<image>"),
        _chat_template(image="<image>\n", **_MISTRAL_TEMPLATE),
        processor=_llava_next_processor, config=_llava_next_config, text_fix=_full_attention),
    "aya_vision": _Family(  # Cohere 2 text: parallel attention + MLP; sliding layers rotate, full ones do not
        "AyaVisionForConditionalGeneration", "Cohere2Config",
        dict(bos_token="<BOS_TOKEN>", eos_token="<|END_OF_TURN_TOKEN|>", pad_token="<PAD>", image_token="<image>"),
        _chat_template("<|START_OF_TURN_TOKEN|>ROLE", "<|END_OF_TURN_TOKEN|>", "<image>",
                       {"user": "<|USER_TOKEN|>", "assistant": "<|CHATBOT_TOKEN|>", "system": "<|SYSTEM_TOKEN|>"},
                       bos="<BOS_TOKEN>"),
        ("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", *_AYA_IMAGE_TOKENS),
        processor=_aya_processor, config=_aya_config, text_fix=_alternating_layers),
    # Command A Vision: Aya Vision's Cohere 2 text; an image is its tiles' <|IMG_PATCH|>s between
    # <|START_OF_IMG|> and <|END_OF_IMG|>, each tile closed by <|IMG_LINE_BREAK|>.
    "cohere2_vision": _Family(
        "Cohere2VisionForConditionalGeneration", "Cohere2Config",
        dict(bos_token="<BOS_TOKEN>", eos_token="<|END_OF_TURN_TOKEN|>", pad_token="<PAD>",
             image_token="<|IMG_PATCH|>", boi_token="<|START_OF_IMG|>", eoi_token="<|END_OF_IMG|>",
             img_line_break_token="<|IMG_LINE_BREAK|>"),
        _chat_template("<|START_OF_TURN_TOKEN|>ROLE", "<|END_OF_TURN_TOKEN|>", "<|IMG_PATCH|>",
                       {"user": "<|USER_TOKEN|>", "assistant": "<|CHATBOT_TOKEN|>", "system": "<|SYSTEM_TOKEN|>"},
                       bos="<BOS_TOKEN>"),
        ("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>"),
        processor=_cohere2_vision_processor, config=_cohere2_vision_config, text_fix=_alternating_layers),
    "qwen3_vl_moe": _Family(  # Qwen3-VL with a mixture-of-experts MLP in every layer
        "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeTextConfig", _QWEN_TOKENS, _QWEN_TEMPLATE, _IM_START,
        processor=_qwen_processor("Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16),
        config=_qwen_config("Qwen3VLMoeConfig", 3), text_fix=_qwen3_moe_text),
    # GLM-4.1V: "[gMASK]<sop><|user|>\n<|begin_of_image|><|image|>...<|end_of_image|>text<|assistant|>\n"; an answer
    # ends where the next turn opens (<|user|>, one of GLM's eos ids), and half of each head is rotated.
    "glm4v": _Family(
        "Glm4vForConditionalGeneration", "Glm4vTextConfig",
        dict(eos_token="<|user|>", pad_token="<|endoftext|>", image_token="<|image|>", video_token="<|video|>"),
        _chat_template("<|ROLE|>\n", "", "<|begin_of_image|><|image|><|end_of_image|>", bos="[gMASK]<sop>"),
        ("[gMASK]", "<sop>", "<|system|>", "<|assistant|>", "<|begin_of_image|>", "<|end_of_image|>",
         "<|begin_of_video|>", "<|end_of_video|>"),
        processor=_glm4v_processor, config=_glm4v_config, text_fix=_mrope(False, partial=0.5)),
    # LFM2-VL: SigLIP 2 + LFM2, whose layers are short gated convolutions (a conv-state cache) or GQA attention.
    "lfm2_vl": _Family(
        "Lfm2VlForConditionalGeneration", "Lfm2Config",
        dict(bos_token="<|startoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>", image_token="<image>",
             image_start_token="<|image_start|>", image_end_token="<|image_end|>",
             image_thumbnail_token="<|img_thumbnail|>"),
        _chat_template(**_CHATML, image="<image>", bos="<|startoftext|>"), _IM_START,
        processor=_lfm2_vl_processor, config=_lfm2_vl_config, text_fix=_lfm2_text),
    # Perception LM: Perception Encoder + Llama 3 text, in Llama 3's turns; an <|image|> per pooled patch.
    "perception_lm": _Family(
        "PerceptionLMForConditionalGeneration", "LlamaConfig",
        dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_pad|>",
             image_token="<|image|>", video_token="<|video|>"),
        _chat_template("<|start_header_id|>ROLE<|end_header_id|>\n\n", "<|eot_id|>", "<|image|>",
                       bos="<|begin_of_text|>"),
        ("<|start_header_id|>", "<|end_header_id|>"),
        processor=_perception_lm_processor, config=_perception_lm_config),
    # Qwen3.5: Qwen3-VL's vision side and prompts; its text mixes Gated DeltaNet and gated full-attention layers.
    "qwen3_5": _Family(
        "Qwen3_5ForConditionalGeneration", "Qwen3_5TextConfig", _QWEN_TOKENS, _QWEN_TEMPLATE, _IM_START,
        processor=_qwen_processor("Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16),
        config=_qwen_config("Qwen3_5Config", 35), text_fix=_qwen3_5_text),
    "qwen3_5_moe": _Family(  # Qwen3.5 with a mixture-of-experts MLP (and a shared expert) in every layer
        "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeTextConfig", _QWEN_TOKENS, _QWEN_TEMPLATE, _IM_START,
        processor=_qwen_processor("Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16),
        config=_qwen_config("Qwen3_5MoeConfig", 35), text_fix=_qwen3_5_moe_text),
    "llama": _Family(
        "LlamaForCausalLM", "LlamaConfig",
        dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_pad|>"),
        _chat_template("<|start_header_id|>ROLE<|end_header_id|>\n\n", "<|eot_id|>", "", bos="<|begin_of_text|>"),
        ("<|start_header_id|>", "<|end_header_id|>")),
    "qwen2": _Family(
        "Qwen2ForCausalLM", "Qwen2Config", dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        _chat_template(**_CHATML, image=""), _IM_START),
}
assert tuple(_SPECS) == FAMILIES


# --------------------------------------------------------------------------- tokenizer / processor
_STANDARD = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@functools.lru_cache(maxsize=None)
def _tokenizer_json(specials: tuple[str, ...]) -> str:
    """Byte-level BPE trained on `_CORPUS` with `specials` first (ids 0..k-1); deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + 512, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok.to_str()


def _make_tokenizer(spec: _Family):
    from tokenizers import Tokenizer

    specials = tuple(dict.fromkeys([*spec.tokens.values(), *spec.extra_tokens]))
    standard = {k: v for k, v in spec.tokens.items() if k in _STANDARD}
    named = {k: v for k, v in spec.tokens.items() if k not in _STANDARD}
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(specials)),
        extra_special_tokens=named or None,
        chat_template=spec.template,
        padding_side="left",
        model_max_length=1024,
        **standard,
    )


@functools.lru_cache(maxsize=None)
def _cached_processor(family: str):
    spec = _SPECS[family]
    tok = _make_tokenizer(spec)
    return spec.processor(tok) if spec.processor else tok


def _processor(family: str):
    return copy.deepcopy(_cached_processor(family))  # callers may mutate their copy freely


# --------------------------------------------------------------------------- public API
def tiny_vlm(family: str, **overrides):
    """Build a tiny randomly initialised `family` model and its processor, offline.

    `family` is one of `FAMILIES` (the HF `config.model_type`). Returns `(model, processor)`: the model is the
    family's `...ForConditionalGeneration` (`...ForCausalLM` for "llama"/"qwen2"), fp32, in eval mode, with
    eager attention (exact and supported by every family); the processor is the family's real processor class
    around a small deterministic BPE tokenizer with the family's special tokens and a chat template (for the
    text-only families it is the tokenizer itself). Weights are seeded locally: the same `family` and
    `overrides` give a bit-identical `state_dict` on every call, and the global RNG state is left untouched.

    `overrides` are applied to the TEXT (decoder) config, e.g. `num_hidden_layers=6` or `hidden_size=96`;
    `head_dim` follows `hidden_size // num_attention_heads` unless given. Keys that the family's text config
    does not define raise `TypeError`. The defaults are hidden 64, intermediate 128, 4 layers, 4 heads,
    2 KV heads, head_dim 16; the vision towers are 2-layer, width-32 ViTs on 28-56 px images. The config ids
    (pad/bos/eos, `config.image_token_id` for every VLM family) and `model.generation_config` match the
    tokenizer, whose length is the vocabulary size.
    """
    if family not in _SPECS:
        raise InputError(f"unknown tiny family {family!r} (tiny:<family>); expected one of {FAMILIES}")
    spec = _SPECS[family]
    text_cls = getattr(tf, spec.text_cfg)
    valid = {f.name for f in dataclasses.fields(text_cls)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise UnknownOverrideError(f"tiny_vlm({family!r}): unknown text-config override(s) {unknown} for "
                                   f"{spec.text_cfg} (a tiny: backbone's backbone_kwargs)")

    processor = _processor(family)
    tok = getattr(processor, "tokenizer", processor)
    kw = {**_TEXT_DEFAULTS, **overrides}
    if "head_dim" not in overrides:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    if spec.text_fix:
        spec.text_fix(kw, overrides)
    kw.update(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
              bos_token_id=tok.bos_token_id if tok.bos_token is not None else None)
    text = text_cls(**{k: v for k, v in kw.items() if k in valid})
    config = spec.config(text, tok, processor) if spec.config else text
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = getattr(tf, spec.model_cls)._from_config(config, attn_implementation=_ATTN, dtype=torch.float32)
    model.eval()
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tok.pad_token_id, tok.eos_token_id
    gen.bos_token_id = tok.bos_token_id if tok.bos_token is not None else None
    return model, processor


def _image(i: int) -> Image.Image:
    """Deterministic RGB test image, different for every `i`."""
    y, x = np.mgrid[0:_IMAGE_PX, 0:_IMAGE_PX]
    chans = [(x * (3 + i) + y * (5 + 2 * i) + 85 * c + 40 * i) % 256 for c in range(3)]
    return Image.fromarray(np.stack(chans, -1).astype(np.uint8), "RGB")


def tiny_inputs(processor, batch: int = 2, with_image: bool = True):
    """Ready inputs for `model(**inputs)` / `model.generate(**inputs)` from a `tiny_vlm` processor.

    A LEFT-padded batch of `batch` single-turn chats of increasing length (so rows really differ in padding
    when `batch >= 2`), rendered with the processor's chat template and a generation prompt. With
    `with_image=True` every sample of an image-taking family gets its own small deterministic PIL image,
    and the result carries whatever the family's forward needs (`pixel_values`, `image_grid_thw`,
    `mm_token_type_ids`, `token_type_ids`, `pixel_attention_mask`, `image_sizes`, ...). For text-only
    families `with_image` is ignored. Returns a `BatchFeature` of tensors; deterministic.
    """
    takes_images = hasattr(processor, "image_processor") and with_image
    chats = []
    for i in range(batch):
        last = len(_PROMPTS) - 1  # texts grow strictly longer with i
        content = [{"type": "text", "text": _PROMPTS[min(i, last)] + " Please be brief." * max(0, i - last)}]
        if takes_images:
            content.insert(0, {"type": "image", "image": _image(i)})
        chats.append([{"role": "user", "content": content}])
    pad = dict(padding=True, padding_side="left")
    kw = dict(add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    if not hasattr(processor, "tokenizer"):  # text-only family: the processor is the tokenizer
        out = processor.apply_chat_template(chats, tokenizer_kwargs={"padding_side": "left"}, padding=True, **kw)
    elif isinstance(processor, tf.PaliGemmaProcessor) and not takes_images:  # it refuses text without images
        tok = processor.tokenizer
        texts = [tok.bos_token + t + "\n" for t in processor.apply_chat_template(chats, add_generation_prompt=True)]
        out = tok(texts, return_tensors="pt", return_token_type_ids=True, **pad)
    else:
        with warnings.catch_warnings():  # PaliGemmaProcessor calls np.array(tensor): numpy 2 DeprecationWarning
            warnings.filterwarnings("ignore", "__array__ implementation", DeprecationWarning)
            out = processor.apply_chat_template(chats, processor_kwargs=pad, **kw)
    out.pop("labels", None)
    return out
