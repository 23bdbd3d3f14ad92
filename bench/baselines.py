"""Baselines outside calibrate: the per-token update oracle (runs every layer to decide what to skip)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor


class UpdateOracle:
    """Per token, skip the layers whose relative update ||f(x)|| / ||x|| is smallest (runs the layer to know).

    Not a method that saves compute: a reference for how well any predictor of "this layer does little
    here" could do. Thresholds per layer sit at the same quantile of that layer's update distribution.
    """

    def __init__(self, model, layers: Iterable[int], layer_modules) -> None:
        self.model = model
        self.layers = list(layers)
        self.modules = layer_modules
        self.thresholds: dict[int, float] = {}
        self.skipped = self.total = 0

    @staticmethod
    def _relative_update(args, kwargs, output) -> tuple[Tensor, Tensor, Tensor]:
        hidden = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        update = (out - hidden).float().norm(dim=-1) / hidden.float().norm(dim=-1).clamp_min(1e-6)
        return hidden, out, update

    @contextlib.contextmanager
    def _hooks(self, hook) -> Iterator[None]:
        handles = [self.modules[i].register_forward_hook(lambda m, a, k, o, i=i: hook(i, a, k, o), with_kwargs=True)
                   for i in self.layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def calibrate(self, batches: list[dict[str, Any]], rate: float) -> None:
        values: dict[int, list[Tensor]] = {i: [] for i in self.layers}

        current: dict[str, Tensor] = {}

        def record(i, args, kwargs, output):
            update = self._relative_update(args, kwargs, output)[2]
            values[i].append(update[current["real"]] if current["real"].shape == update.shape else update.flatten())

        with self._hooks(record):
            for batch in batches:
                current["real"] = batch["attention_mask"].bool()  # padding says nothing about real tokens
                self.model(**batch)
        self.thresholds = {i: float(torch.quantile(torch.cat(v), min(max(rate, 0.0), 1.0))) for i, v in values.items()}

    @contextlib.contextmanager
    def skipping(self) -> Iterator["UpdateOracle"]:
        def replace(i, args, kwargs, output):
            hidden, out, update = self._relative_update(args, kwargs, output)
            skip = update < self.thresholds[i]
            self.skipped += int(skip.sum())
            self.total += skip.numel()
            return torch.where(skip[..., None], hidden, out)

        with self._hooks(replace):
            yield self

    @property
    def skip_fraction(self) -> float:
        return self.skipped / self.total if self.total else 0.0
