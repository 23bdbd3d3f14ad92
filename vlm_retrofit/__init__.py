"""vlm_retrofit: retrofit depth routers into frozen vision-language models and skip blocks at generation time."""

from .backbones import BackboneSpec, register_backbone
from .routing import AdapterMismatchError, RouterAdapter, RouterConfig, attach_routers

__version__ = "0.1.0"


def __getattr__(name: str):
    # Training pulls in Lightning: import it only when asked for, so inference and releases stay light.
    if name == "RetrofitModule":
        from .training import RetrofitModule

        return RetrofitModule
    raise AttributeError(f"module 'vlm_retrofit' has no attribute {name!r}")


__all__ = [
    "AdapterMismatchError",
    "BackboneSpec",
    "RouterAdapter",
    "RetrofitModule",
    "RouterConfig",
    "attach_routers",
    "register_backbone",
]
