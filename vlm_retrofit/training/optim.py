"""Optimizer over trainable parameters only, and the warmup + cosine/linear/constant learning-rate schedule."""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..errors import InputError

SCHEDULES = ("cosine", "linear", "constant")


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """`"AdamW"` (any class in `torch.optim`) or a dotted path such as `"bitsandbytes.optim.AdamW8bit"`."""
    if "." not in name:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            raise InputError(f"unknown optimizer {name!r}: not in torch.optim (give a dotted path for others)")
        return cls
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _decays(name: str, param: torch.Tensor) -> bool:
    # Norm gains (init 1) and biases must not be pulled toward 0; router queries and LoRA matrices may be.
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim > 0 and leaf not in ("bias", "key_norm_weight", "norm_weight") and not leaf.endswith("norm")


def _is_query(name: str) -> bool:
    return name.rsplit(".", 1)[-1] == "query"  # router pseudo-queries and gate queries


def _is_lora_b(name: str) -> bool:
    return ".lora_B." in name  # peft: <module>.lora_B.<adapter>.weight (the up-projection, zero at init)


def _is_stand_in(name: str) -> bool:
    return ".stand_ins." in name  # adapter.stand_ins.<layer>.weight / .bias


def parameter_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float, lr: float = 1e-3,
                     query_lr_scale: float = 1.0, lora_b_lr_scale: float = 1.0,
                     stand_in_lr_scale: float = 1.0) -> list[dict[str, Any]]:
    """The parameters that require grad, grouped: decayed, router/gate queries (decayed, lr x `query_lr_scale`),
    LoRA B matrices (decayed, lr x `lora_b_lr_scale`), stand-ins of skipped layers (lr x `stand_in_lr_scale`, not
    decayed: their fit is not pulled toward an identity skip) and not decayed (biases, norm gains). A scaled group
    carries a `name`; the base learning rate is that of the unnamed groups."""
    decay, queries, lora_b, stand_ins, no_decay = [], [], [], [], []
    for name, param in named:
        if not param.requires_grad:
            continue
        if _is_stand_in(name):
            stand_ins.append(param)
        elif not _decays(name, param):
            no_decay.append(param)
        elif _is_query(name) and query_lr_scale != 1.0:
            queries.append(param)
        elif _is_lora_b(name) and lora_b_lr_scale != 1.0:
            lora_b.append(param)
        else:
            decay.append(param)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if queries:
        groups.append({"params": queries, "weight_decay": weight_decay, "lr": lr * query_lr_scale, "name": "queries"})
    if lora_b:
        groups.append({"params": lora_b, "weight_decay": weight_decay, "lr": lr * lora_b_lr_scale, "name": "lora_B"})
    if stand_ins:
        groups.append({"params": stand_ins, "weight_decay": 0.0, "lr": lr * stand_in_lr_scale, "name": "stand_ins"})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if not groups:
        raise ValueError("no trainable parameters: the router adapter (and LoRA, if any) should require grad")
    return groups


def build_optimizer(named: Iterable[tuple[str, nn.Parameter]], name: str = "AdamW", lr: float = 1e-3,
                    weight_decay: float = 0.0, kwargs: dict[str, Any] | None = None,
                    query_lr_scale: float = 1.0, lora_b_lr_scale: float = 1.0,
                    stand_in_lr_scale: float = 1.0) -> torch.optim.Optimizer:
    for label, scale in (("query_lr_scale", query_lr_scale), ("lora_b_lr_scale", lora_b_lr_scale)):
        if scale <= 0:
            raise InputError(f"{label} must be > 0, got {scale}")
    if stand_in_lr_scale < 0:
        raise InputError(f"stand_in_lr_scale must be >= 0, got {stand_in_lr_scale}")
    groups = parameter_groups(named, weight_decay, lr, query_lr_scale, lora_b_lr_scale, stand_in_lr_scale)
    return optimizer_class(name)(groups, lr=lr, **(kwargs or {}))


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The current learning rate of the parameters at the base `lr` (not a scaled, named group)."""
    groups = optimizer.param_groups
    return float(next((g for g in groups if "name" not in g), groups[0])["lr"])


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base LR at optimizer step `step`: linear warmup, then cosine / linear decay to
    `min_lr_ratio` at `total_steps` (constant when `total_steps` is None or the schedule is "constant")."""
    if schedule not in SCHEDULES:
        raise InputError(f"scheduler must be one of {SCHEDULES}, got {schedule!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise InputError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or not total_steps:
            return 1.0
        progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor
