"""The baselines trained variants are compared with: static removal, random skipping, the per-token update oracle."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor

from vlm_retrofit.backbones import image_positions
from vlm_retrofit.batch import model_inputs

from .evaluate import nullmethod
from .measuring import (SKIP_IMAGE_POSITIONS, Bench, calibrated_per_workload, candidates_at, operating_point,
                        with_replacement)


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


def measure_baselines(bench: Bench, targets: list[float], speed_target: float, removal_order: list[int],
                      joint_order: list[int], log: Callable[[str], None], *, cache: Path, key: dict[str, Any], reuse: bool,
                      span_order: list[int] | None = None) -> list[dict[str, Any]]:
    """Static removal (Block Influence, greedy by single-block impact, greedy joint, greedy joint with a linear
    replacement of the removed spans, and, given `span_order`, the cheapest span continued greedily), random
    skipping and the update oracle at every target, each of the last two also restricted to the blocks our
    per-token policies may skip there (`candidate_count` of `removal_order`: "-cheapest").

    Their quality is a deterministic function of the model, the eval set and the settings. With `reuse`, the
    records of an earlier run with the same key (settings, removal order, the base's outputs) are taken from
    `cache` and only their decode speed is measured again, side by side with the base in this run. Every run
    stores its records in `cache` under its key, beside those of runs with other keys (other targets, say).
    """
    from vlm_retrofit import RouterConfig, attach_routers, calibrate
    from vlm_retrofit.pruning import layers_removed

    from .resume import run_key

    model, data, records = bench.model, bench.data, []
    # Random and the oracle are calibrated per workload and counted where our per-token rows are (`--counted-on`).
    counted_on = bench.per_token_counted_on
    key = {**key, **run_key(bench, targets, speed_target, removal_order),
           "oracle_calibration": "bisected to the realised fraction",
           "skipping_recorded": "per workload; Block Influence on real text positions",
           "span_order": list(span_order or []),
           "per_token_baselines": ("image positions skip" if SKIP_IMAGE_POSITIONS else "image positions run every block")
           + "; random hashed on position and decoder-input bits"}
    stored = next((entry["records"] for entry in cached_baselines(cache) if entry["key"] == key), []) if reuse else []
    earlier = {(r["method"], r["target"]): r for r in stored}
    if reuse:
        log(f"baselines: reusing {len(earlier)} records from {cache}" if earlier else
            f"baselines: nothing to reuse in {cache} (missing, or measured with other settings): measuring all")

    identity = attach_routers(model, RouterConfig(block_size=1))  # routers at init: plain layer dropping
    bench.base_method = identity.unhooked
    layout = identity.layout

    deleted: list[dict[str, Any]] = []  # static records at the speed target: timed later without any routers

    def replaced_point(target: float) -> None:
        # ReplaceMe-style, training-free: the greedy joint removal, each removed span replaced by a least-squares
        # map folded into the layer in front of it, fitted on train-split batches. Same cost as plain removal.
        from vlm_retrofit.replacement import fit_replacements

        name = "static-greedy-joint-replaced"
        blocks = calibrate(identity, data.calibration, target, "static", store=False, order=joint_order).settings["blocks"]
        settings = {"blocks": blocks, "replacement_batches": len(data.replacement_calibration)}
        before = earlier.get((name, target))
        if before is not None and before.get("settings") == settings:
            records.append({**before, "quality_from_earlier_run": True})
        else:
            layers = layout.layers_of_blocks(blocks)
            with identity.disabled():
                transforms = fit_replacements(model, identity.spec, layers, data.replacement_calibration)
            method, _ = with_replacement(lambda: identity.skipping("static", blocks=blocks), model, identity.spec,
                                         (transforms, layers), layers)
            records.append(operating_point(name, target, bench.measure(method, speed=False), settings=settings))
        if target == speed_target:  # folding changes weights, not cost: timed as the plain removal is
            deleted.append(records[-1])
        log(f"{name} @ {target:.2f}: {records[-1]}")

    def point(name: str, target: float, policy: str, settings: Callable[[], dict[str, Any]],
              fixed: dict[str, Any] | None = None) -> None:
        # Static removal is timed as shipped (layers deleted, below); random needs the routing machinery.
        # `settings` gives a static removal's settings, or random's per workload (calibrated_per_workload).
        speed = target == speed_target and policy != "static"
        before = earlier.get((name, target))
        fresh_settings = settings() if policy == "static" else None  # cheap; an earlier record must match it
        if before is not None and fresh_settings is not None and before.get("settings") != fresh_settings:
            before = None
        if before is not None and fixed and any(before["settings"].get(k) != v for k, v in fixed.items()):
            before = None  # e.g. random skipping restricted to other candidate blocks
        if before is not None and policy != "static" and before.get("counted_on") != counted_on:
            before = None  # calibrated where the target counted other positions
        if before is None and policy == "static":
            chosen = fresh_settings
            records.append(operating_point(name, target, bench.measure(lambda: identity.skipping(policy, **chosen), speed=False),
                                   settings=chosen))
        elif before is None:
            per_workload = settings()
            chosen = per_workload["captions"]
            metrics = bench.measure(lambda: identity.skipping(policy, **chosen), speed=speed,
                                    text_method=lambda: identity.skipping(policy, **per_workload["text"]))
            records.append(operating_point(name, target, metrics, settings=chosen, text_settings=per_workload["text"],
                                   counted_on=counted_on))
        else:
            chosen = before["settings"]
            fresh = bench.measure_speed(lambda: identity.skipping(policy, **chosen)) if speed else {}
            records.append({**before, **fresh, "quality_from_earlier_run": True})
        if policy == "static" and target == speed_target:
            deleted.append(records[-1])
        log(f"{name} @ {target:.2f}: {records[-1]}")

    for target in targets:
        for name, order in (("static-block-influence", None), ("static-greedy-impact", removal_order),
                            ("static-greedy-joint", joint_order), *([("static-span", span_order)] if span_order else [])):
            point(name, target, "static", lambda o=order, t=target: calibrate(
                identity, data.calibration, t, "static", store=False, order=o).settings)
        point("random", target, "random", lambda t=target: calibrated_per_workload(
            identity, data, t, "random", bench.tolerance, skip_image_positions=SKIP_IMAGE_POSITIONS,
            counted_on=counted_on))
        # Random skipping over the blocks our per-token policies may skip: what their learned signal must beat.
        cheap = candidates_at(identity, removal_order, target)
        point("random-cheapest", target, "random", lambda t=target, c=cheap: calibrated_per_workload(
            identity, data, t, "random", bench.tolerance, candidates=c, skip_image_positions=SKIP_IMAGE_POSITIONS,
            counted_on=counted_on), fixed={"blocks": cheap})
        if data.replacement_calibration:
            replaced_point(target)
    skippable_layers = layout.layers_of_blocks(layout.skippable_blocks)
    identity.detach()
    bench.base_method = nullmethod
    for record in deleted:  # the plain model is the base: no hooks on either side
        layers = layout.layers_of_blocks(record["settings"]["blocks"])
        record.update(bench.measure_speed(lambda: layers_removed(model, identity.spec, layers)),
                      speed_measured_as="layers deleted, no routers attached")
        log(f"{record['method']} @ {record['target']:.2f} decode with the layers deleted: "
            f"{record['decode_speedup_b1']:.3f}x (B=1), {record['decode_speedup_b8']:.3f}x (B=8)")

    # The update oracle over every skippable layer, and over the layers our per-token policies may skip.
    for name, cheapest in (("oracle-update (runs every layer)", False), ("oracle-update-cheapest (runs every layer)", True)):
        for target in targets:
            layers = candidates_at(identity, removal_order, target) if cheapest else skippable_layers
            extra: dict[str, Any] = {"candidate_blocks": layers} if cheapest else {}
            if not SKIP_IMAGE_POSITIONS:
                extra["image_positions"] = "run every block"
            extra["counted_on"] = counted_on
            before = earlier.get((name, target))
            if before is not None and all(before.get(k) == v for k, v in extra.items()):
                records.append({**before, "quality_from_earlier_run": True})
            else:
                # Calibrated on each workload where its target counts, as our per-token rows are.
                image_ids = () if SKIP_IMAGE_POSITIONS else identity.spec.image_token_ids(model.config)

                def calibrated_oracle(batches, layers=layers, target=target):
                    oracle = UpdateOracle(model, layers, identity.spec.get_layers(model), image_token_ids=image_ids)
                    realised = oracle.calibrate(batches, target * layout.num_layers / len(layers),
                                                counted_on=counted_on or "text")
                    return oracle, realised * len(layers) / layout.num_layers

                oracles = data.per_workload(calibrated_oracle)
                metrics = bench.measure(oracles["captions"][0].skipping, speed=False,
                                        text_method=oracles["text"][0].skipping)
                for workload, prefix in (("captions", ""), ("text", "text_")):
                    metrics[f"{prefix}calibration_skipped_fraction"] = oracles[workload][1]
                records.append(operating_point(name, target, metrics, **extra))
            log(f"{name} @ {target:.2f}: {records[-1]}")
    store_baselines(cache, key, records)
    return records


BASELINE_CACHE_ENTRIES = 8  # runs with different keys (targets, settings, builds) kept side by side in the cache


def cached_baselines(cache: Path) -> list[dict[str, Any]]:
    """The baseline records stored in `cache`, one `{"key", "records"}` entry per run key, oldest first (a cache
    written before 2026-12-06 held a single run's)."""
    if not cache.is_file():
        return []
    stored = json.loads(cache.read_text())
    return stored.get("entries", [stored] if "key" in stored else [])


def store_baselines(cache: Path, key: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Store a run's baseline `records` in `cache` under `key`: they replace that key's, the other keys' stay (the
    newest `BASELINE_CACHE_ENTRIES` in all)."""
    from vlm_retrofit.files import atomic_write

    entries = [entry for entry in cached_baselines(cache) if entry["key"] != key][-(BASELINE_CACHE_ENTRIES - 1):]
    cache.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"entries": entries + [{"key": key, "records": records}]}, indent=2) + "\n"
    atomic_write(cache, lambda tmp: Path(tmp).write_text(text))
