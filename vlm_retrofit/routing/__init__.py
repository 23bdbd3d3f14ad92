"""Depth routing: RouterConfig, the router math, and the hook-based RouterAdapter."""

from .adapter import AdapterMismatchError, RouterAdapter, attach_routers, check_fingerprint, get_adapter, read_adapter_config
from .config import BlockLayout, RouterConfig
from .identity import check_identity
from .router import DepthRouter, SkipGate, rms_normalize
from .stand_in import StandIn, fit_stand_ins
from .stream import SourceStack, StreamState

__all__ = [
    "AdapterMismatchError",
    "BlockLayout",
    "DepthRouter",
    "RouterAdapter",
    "RouterConfig",
    "SkipGate",
    "SourceStack",
    "StandIn",
    "StreamState",
    "attach_routers",
    "check_fingerprint",
    "check_identity",
    "fit_stand_ins",
    "get_adapter",
    "read_adapter_config",
    "rms_normalize",
]
