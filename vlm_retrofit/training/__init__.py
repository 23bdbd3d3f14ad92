"""Distillation training of the depth routers: RetrofitModule (Lightning), losses, optimizer, checkpoints."""

from .checkpoint import CHECKPOINT_KEY, RetrofitCheckpoint, inspect_checkpoint
from .data import FixedBatchDataModule
from .losses import compute_penalty, distillation_kl, drop_rate_at, routing_entropy
from .module import RetrofitModule
from .run_logger import RunCSVLogger

__all__ = [
    "CHECKPOINT_KEY",
    "FixedBatchDataModule",
    "RetrofitCheckpoint",
    "RetrofitModule",
    "RunCSVLogger",
    "compute_penalty",
    "distillation_kl",
    "drop_rate_at",
    "inspect_checkpoint",
    "routing_entropy",
]
