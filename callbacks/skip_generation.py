"""SkipAwareGenerationCallback: at validation, generate with and without skipping and log what skipping cost."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any, Callable, ContextManager, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor

from vlm_retrofit.skipping import SkipReport, calibrate
from vlm_retrofit.batch import model_inputs
from vlm_retrofit.errors import InputError
from vlm_retrofit.text_metrics import rouge_l


def prompts_from_batch(batch: Mapping[str, Any], pad_token_id: int) -> dict[str, Any]:
    """Cut a right-padded training batch down to its prompts (everything before the first response token),
    left-padded for generation. Images sit in the prompt, so visual inputs stay valid as they are."""
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    rows, length = ids.shape
    attention = batch.get("attention_mask", torch.ones_like(ids))
    lengths = []
    for row in range(rows):
        first = loss_mask[row].nonzero()
        lengths.append(int(first[0]) + 1 if len(first) else int(attention[row].sum()))
    width = max(lengths)
    prompts: dict[str, Any] = {}
    for key, value in model_inputs(batch).items():
        if isinstance(value, Tensor) and value.dim() == 2 and tuple(value.shape) == (rows, length):
            fill = pad_token_id if key == "input_ids" else 0
            padded = torch.full((rows, width), fill, dtype=value.dtype, device=value.device)
            for row, n in enumerate(lengths):
                padded[row, width - n:] = value[row, :n]
            value = padded
        prompts[key] = value
    return prompts


def generation_pad_id(tokenizer) -> int:
    """The id generation pads with: the tokenizer's pad token, else its end-of-sequence token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class SkipAwareGenerationCallback(pl.Callback):
    """Generate on validation prompts with skipping and without it, and log the trade-off.

    Logged (rank 0): `skip/compute_saved` (decoder-block FLOPs, from what ran: in batches only steps every row
    skips save), `skip/skipped_layer_fraction` (token-level), `skip/token_match` and
    `skip/rouge_l` (agreement of the skipping output with the unskipped one), `skip/tokens_per_s`,
    `skip/base_tokens_per_s`, `skip/block_<n>` skip rates, and a per-block skip-rate bar chart
    (TensorBoard image, or a PNG in the logger's folder for CSV). A summary table is printed.
    """

    def __init__(self, enabled: bool = True, every_n_epochs: int = 1, max_samples: int = 8, max_new_tokens: int = 16,
                 policy: str | None = None, target_saving: float = 0.25) -> None:
        """
        Args:
            enabled: False turns the callback off entirely (it then costs nothing).
            every_n_epochs: run on validation passes whose epoch is a multiple of this.
            max_samples: generate for at most this many validation samples (whole batches, from the first).
            max_new_tokens: tokens generated per sample, greedy, both ways.
            policy: skip policy (`recent_weight`, `gate`, `static`, `random`); None: `gate` where the routers
                have skip gates, else `recent_weight`.
            target_saving: fraction of layer executions to skip; the policy's thresholds are calibrated for it on
                these prompts each time (the routers change during training), unless the adapter already
                carries a calibration for this target.
        """
        super().__init__()
        self.enabled, self.every_n_epochs = enabled, max(1, int(every_n_epochs))
        self.max_samples, self.max_new_tokens = int(max_samples), int(max_new_tokens)
        self.policy, self.target_saving = policy, float(target_saving)
        self.active_policy = policy or "recent_weight"
        """The policy generating runs with: `policy`, or the model's when None (resolved in `setup`)."""
        self._batches: list[Mapping[str, Any]] = []
        self._warned_replacement = False
        self.last_metrics: dict[str, float] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        adapter = getattr(pl_module, "adapter", None)
        if adapter is None:
            return
        # The configured policy stays as given: a callback set up again for another model resolves None anew.
        self.active_policy = self.policy or ("gate" if adapter.config.skip_gate else "recent_weight")
        if self.enabled and self.active_policy == "gate" and not adapter.config.skip_gate:
            # Before any step or validation batch: found at the first validation's end, it stopped the run there.
            raise InputError("SkipAwareGenerationCallback's policy 'gate' needs routers with skip gates, and this "
                             "model has none (router.skip_gate: false): give the callback another policy "
                             "(recent_weight, static, random) as the run's --config does, or enabled: false")

    def _warn_if_replacement_unused(self, pl_module: pl.LightningModule, removed_layers: list[int]) -> None:
        """Say once when the static removal measured is not the one the student's replacement was fitted for: the
        replacement then stays out and the token match is that of the bare removal."""
        if self._warned_replacement or not pl_module.replacements or pl_module.replacement_fits(removed_layers):
            return
        self._warned_replacement = True
        rank_zero_warn(f"SkipAwareGenerationCallback: the static removal at target_saving={self.target_saving} removes "
                       f"layers {sorted(removed_layers)}, and the replacement was fitted for layers "
                       f"{sorted(pl_module.replacement_layers())}: the logged token match is the removal's without the "
                       "replacement. Set the callback's target_saving to the removal schedule's largest removal to "
                       "measure the student")

    def _active(self, trainer: pl.Trainer) -> bool:
        return (self.enabled and not trainer.sanity_checking and trainer.is_global_zero
                and trainer.current_epoch % self.every_n_epochs == 0)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._active(trainer) and sum(len(b["input_ids"]) for b in self._batches) < self.max_samples:
            self._batches.append(batch)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active(trainer) or not self._batches:
            return
        model, adapter, processor = pl_module.model, pl_module.adapter, pl_module.processor
        tokenizer = getattr(processor, "tokenizer", processor)
        prompts = [prompts_from_batch(b, generation_pad_id(tokenizer)) for b in self._batches]
        key = f"{self.target_saving:.4f}"
        settings = adapter.calibration.get(self.active_policy, {}).get(key)
        if settings is None:
            # An adapter whose compute target was counted on the answers (`compute_counted_on`) is calibrated on
            # them, where the whole validation batches' loss_mask marks them; else on the prompts generated from.
            on_answers = adapter.compute_counted_on == "response" and self.active_policy != "static"
            settings = calibrate(adapter, self._batches if on_answers else prompts, self.target_saving,
                                 self.active_policy, store=False).settings
        # A healing run's replacement of the removed layers belongs to its student: the static removal runs with it.
        replaced = getattr(pl_module, "replacement_applied", None)
        skip_context = None
        if replaced is not None and "blocks" in settings:
            removed = adapter.layout.layers_of_blocks(settings["blocks"])
            self._warn_if_replacement_unused(pl_module, removed)
            skip_context = functools.partial(replaced, removed)
        metrics, report = compare_generation(model, adapter, prompts, self.active_policy, settings, tokenizer,
                                             max_new_tokens=self.max_new_tokens, skip_context=skip_context)
        self.last_metrics = metrics
        pl_module.log_dict(metrics, rank_zero_only=True)
        rates = report.skip_rates
        self._plot(trainer, rates)
        self._print(trainer, metrics, rates)

    @rank_zero_only
    def _plot(self, trainer: pl.Trainer, rates: list[float]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(max(4, 0.35 * len(rates)), 2.5))
        axis.bar(range(len(rates)), rates)
        axis.set(xlabel="block", ylabel="skip rate", ylim=(0, 1),
                 title=f"{self.active_policy}, epoch {trainer.current_epoch}")
        figure.tight_layout()
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_figure"):
                experiment.add_figure("skip/block_rates", figure, global_step=trainer.global_step)
            elif getattr(logger, "log_dir", None):
                os.makedirs(logger.log_dir, exist_ok=True)
                figure.savefig(os.path.join(logger.log_dir, f"skip_rates_epoch{trainer.current_epoch}.png"))
        plt.close(figure)

    @rank_zero_only
    def _print(self, trainer: pl.Trainer, metrics: dict[str, float], rates: list[float]) -> None:
        rows = [("compute saved", f"{100 * metrics['skip/compute_saved']:.1f} %"),
                ("layer executions skipped", f"{100 * metrics['skip/skipped_layer_fraction']:.1f} %"),
                ("token match", f"{100 * metrics['skip/token_match']:.1f} %"),
                ("ROUGE-L vs unskipped", f"{metrics['skip/rouge_l']:.3f}"),
                ("tokens/s skip | base", f"{metrics['skip/tokens_per_s']:.1f} | {metrics['skip/base_tokens_per_s']:.1f}"),
                ("skip rate per block", " ".join(f"{r:.2f}" for r in rates))]
        width = max(len(name) for name, _ in rows)
        print(f"\nskip-aware generation ({self.active_policy}, target {100 * self.target_saving:.0f} %, "
              f"epoch {trainer.current_epoch})")
        for name, value in rows:
            print(f"  {name:<{width}}  {value}")


@torch.no_grad()
def compare_generation(model, adapter, prompts: list[dict[str, Any]], policy: str, settings: Mapping[str, Any],
                       tokenizer, *, max_new_tokens: int = 16,
                       skip_context: Callable[[], ContextManager] | None = None) -> tuple[dict[str, float], SkipReport]:
    """Greedy generation on each prompt batch without and with skipping (inside `skip_context()` too, e.g. a
    healing run's replacement of the layers skipped); agreement, speed and compute.

    Returns `skip/...` metrics (see SkipAwareGenerationCallback) and the merged SkipReport of the skipping runs.
    """
    pad = generation_pad_id(tokenizer)
    options = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    matches = total = generated = 0
    base_time = skip_time = 0.0
    base_texts, skip_texts, reports = [], [], []
    for prompt in prompts:
        start_len = prompt["input_ids"].shape[1]
        start = time.perf_counter()
        base = model.generate(**prompt, **options)[:, start_len:]
        base_time += time.perf_counter() - start
        start = time.perf_counter()
        with (skip_context or contextlib.nullcontext)(), adapter.skipping(policy, **settings) as report:
            skip = model.generate(**prompt, **options)[:, start_len:]
        skip_time += time.perf_counter() - start
        reports.append(report)
        width = max(base.shape[1], skip.shape[1])
        base = torch.nn.functional.pad(base, (0, width - base.shape[1]), value=pad)
        skip = torch.nn.functional.pad(skip, (0, width - skip.shape[1]), value=pad)
        matches += int((base == skip).sum())
        total += base.numel()
        generated += base.numel()
        base_texts += tokenizer.batch_decode(base, skip_special_tokens=True)
        skip_texts += tokenizer.batch_decode(skip, skip_special_tokens=True)
    report = SkipReport.merged(reports)
    metrics = {
        "skip/compute_saved": report.compute_saved,
        "skip/skipped_layer_fraction": report.skipped_layer_fraction,
        "skip/token_match": matches / total if total else 1.0,
        "skip/rouge_l": rouge_l(skip_texts, base_texts),
        "skip/tokens_per_s": generated / skip_time if skip_time else 0.0,
        "skip/base_tokens_per_s": generated / base_time if base_time else 0.0,
    }
    for block, rate in enumerate(report.skip_rates):
        metrics[f"skip/block_{block}"] = rate
    return metrics, report
