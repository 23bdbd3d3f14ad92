"""vlm_retrofit: retrofit depth routers into frozen vision-language models and skip blocks at generation time."""

from .backbones import BackboneSpec, register_backbone
from .routing import AdapterMismatchError, RouterAdapter, RouterConfig, attach_routers, get_adapter
from .release import load_release
from .skipping import SkipReport, calibrate

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
    "SkipReport",
    "attach_routers",
    "calibrate",
    "get_adapter",
    "load_release",
    "register_backbone",
]
