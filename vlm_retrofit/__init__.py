"""vlm_retrofit: retrofit depth routers into frozen vision-language models and skip blocks at generation time."""

from .backbones import BackboneSpec, register_backbone
from .routing import AdapterMismatchError, RouterAdapter, RouterConfig, attach_routers

__version__ = "0.1.0"

__all__ = [
    "AdapterMismatchError",
    "BackboneSpec",
    "RouterAdapter",
    "RouterConfig",
    "attach_routers",
    "register_backbone",
]
