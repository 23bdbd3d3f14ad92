"""Baselines outside calibrate: the per-token update oracle (runs every layer to decide what to skip)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from vlm_retrofit.backbones import image_positions
from vlm_retrofit.batch import model_inputs


@dataclass
class OracleCount:
    """The oracle's skipped / total layer executions over one `UpdateOracle.skipping` context, over real tokens and
    over real text tokens (image placeholders left out), as a `SkipReport` counts them."""

    layer_share: float
    """The oracle's layers as a share of all decoder layers (its skips as a fraction of every layer's executions)."""
    skipped: int = 0
    total: int = 0
    text_skipped: int = 0
    text_total: int = 0

    @property
    def skip_fraction(self) -> float:
        """Over the oracle's layers."""
        return self.skipped / self.total if self.total else 0.0

    @property
    def text_skip_fraction(self) -> float:
        """Over the oracle's layers, real text tokens only."""
        return self.text_skipped / self.text_total if self.text_total else 0.0

    @property
    def skipped_layer_fraction(self) -> float:
        """Over every decoder layer, as `SkipReport.skipped_layer_fraction` counts."""
        return self.skip_fraction * self.layer_share

    @property
    def skipped_text_layer_fraction(self) -> float:
        """Over every decoder layer, real text tokens only, as `SkipReport.skipped_text_layer_fraction` counts."""
        return self.text_skip_fraction * self.layer_share

    @classmethod
    def merged(cls, counts: "list[OracleCount]") -> "OracleCount":
        return cls(counts[0].layer_share, *(sum(getattr(c, name) for c in counts)
                                            for name in ("skipped", "total", "text_skipped", "text_total")))


class UpdateOracle:
    """Per token, skip the layers whose relative update ||f(x)|| / ||x|| is smallest (runs the layer to know).

    Not a method that saves compute: a reference for how well any predictor of "this layer does little
    here" could do. Thresholds per layer sit at the same quantile of that layer's update distribution.
    Given `image_token_ids`, visual-placeholder positions run every layer and the target counts real text
    positions, as our per-token policies do with `skip_image_positions=False`.
    """

    def __init__(self, model, layers: Iterable[int], layer_modules, image_token_ids: Iterable[int] = ()) -> None:
        self.model = model
        self.layers = list(layers)
        self.modules = layer_modules
        self.thresholds: dict[int, float] = {}
        self.image_token_ids = torch.tensor(sorted(image_token_ids), dtype=torch.long)
        self._image: Tensor | None = None
        """Bool [B, T] of the image positions in the current call of the model (None: none, or not kept)."""

    @staticmethod
    def _relative_update(args, kwargs, output) -> tuple[Tensor, Tensor, Tensor]:
        hidden = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        update = (out - hidden).float().norm(dim=-1) / hidden.float().norm(dim=-1).clamp_min(1e-6)
        return hidden, out, update

    def _capture_image_positions(self, module, args, kwargs) -> None:
        self._image = image_positions(kwargs.get("input_ids", args[0] if args else None), self.image_token_ids)

    def _masks(self, shape: torch.Size, real: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(real tokens, real text tokens, image positions) of a layer call's [B, T] positions; None where every
        position counts (no image: none)."""
        real = real if real is not None and real.shape == shape else None
        image = self._image if self._image is not None and self._image.shape == shape else None
        if image is None:
            return real, real, None
        return real, ~image if real is None else real & ~image, image

    @contextlib.contextmanager
    def _hooks(self, hook) -> Iterator[None]:
        handles = [self.modules[i].register_forward_hook(lambda m, a, k, o, i=i: hook(i, a, k, o), with_kwargs=True)
                   for i in self.layers]
        handles.append(self.model.register_forward_pre_hook(self._capture_image_positions, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._image = None

    @torch.no_grad()
    def calibrate(self, batches: list[dict[str, Any]], rate: float, *, tolerance: float = 0.005,
                  max_steps: int = 14, counted_on: str = "text") -> float:
        """Thresholds under which the oracle, skipping, skips `rate` of the real tokens' layer executions on
        `batches` (of the real text tokens' with `image_token_ids`); returns the fraction it realises there.
        `counted_on="response"`: of the answer tokens' instead (each batch's `loss_mask`), as
        `calibrate(counted_on="response")` counts our per-token policies' targets.

        Every layer's threshold sits at one quantile q of that layer's updates in the full model (at the positions
        the target counts). Skipping changes the stream the layers above see, so q = rate does not realise rate
        (on the real VLM only about half of it: the layers above a skipped one update more); q is bisected on the
        realised fraction until it is within `tolerance` of rate.
        """
        if counted_on not in ("text", "response"):
            raise ValueError(f"counted_on must be 'text' or 'response', not {counted_on!r}")
        if counted_on == "response" and any(batch.get("loss_mask") is None for batch in batches):
            raise ValueError("counted_on='response' needs a loss_mask in every calibration batch")
        counted_key = "loss_mask" if counted_on == "response" else "attention_mask"
        inputs = [model_inputs(batch) for batch in batches]
        values: dict[int, list[Tensor]] = {i: [] for i in self.layers}
        current: dict[str, Tensor] = {}

        def record(i, args, kwargs, output):
            update = self._relative_update(args, kwargs, output)[2]
            counted = self._masks(update.shape, current["real"])[1]  # padding says nothing about real tokens
            values[i].append(update.flatten() if counted is None else update[counted])

        def run() -> None:
            for batch, model_batch in zip(batches, inputs):
                current["real"] = batch[counted_key].bool()
                self.model(**model_batch)

        with self._hooks(record):
            run()
        updates = {i: torch.cat(v) for i, v in values.items()}
        rate = min(max(rate, 0.0), 1.0)

        def realised(q: float) -> float:
            self.thresholds = {i: float(torch.quantile(u, q)) for i, u in updates.items()}
            with self.skipping(real=current) as count:
                run()
            return count.text_skip_fraction if self.image_token_ids.numel() else count.skip_fraction

        fraction = realised(rate)
        low, high = (rate, 1.0) if fraction < rate else (0.0, rate)  # the realised fraction grows with q
        for _ in range(max_steps):
            if abs(fraction - rate) <= tolerance or rate in (0.0, 1.0):
                break
            q = (low + high) / 2
            fraction = realised(q)
            if fraction < rate:
                low = q
            else:
                high = q
        return fraction

    @contextlib.contextmanager
    def skipping(self, real: dict[str, Tensor] | None = None) -> Iterator[OracleCount]:
        """Skip, per token, each layer whose update falls under its threshold (image positions never, given
        `image_token_ids`); yields the count of skipped / total executions of its layers in this context (only the
        real tokens' where `real["real"]` holds the current batch's attention mask)."""
        count = OracleCount(len(self.layers) / len(self.modules))

        def replace(i, args, kwargs, output):
            hidden, out, update = self._relative_update(args, kwargs, output)
            skip = update < self.thresholds[i]
            real_mask, text_mask, image = self._masks(skip.shape, real["real"] if real is not None else None)
            if image is not None:
                skip = skip & ~image
            count.skipped += int(skip.sum() if real_mask is None else (skip & real_mask).sum())
            count.total += skip.numel() if real_mask is None else int(real_mask.sum())
            count.text_skipped += int(skip.sum() if text_mask is None else (skip & text_mask).sum())
            count.text_total += skip.numel() if text_mask is None else int(text_mask.sum())
            return torch.where(skip[..., None], hidden, out)

        with self._hooks(replace):
            yield count
