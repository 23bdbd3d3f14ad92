"""Training one bench variant within a wall-clock budget, and telling whether an adapter trained before is reusable."""

from __future__ import annotations

import hashlib
import json
import resource
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from vlm_retrofit.hardware import fast_bf16

from .variants import Variant


# What a compute target counts in training (`SkipSimulation.counted_positions`); gates trained before counted
# padding and image placeholders too, met their target by skipping those, and are trained again.
COMPUTE_COUNTED_ON = {"text": "real text positions", "response": "answer positions"}


def compute_counted_on(variant: Variant) -> str:
    """Where `variant`'s compute target is counted in training, as train_info.json records it."""
    import inspect

    from vlm_retrofit.training import RetrofitModule

    default = inspect.signature(RetrofitModule.__init__).parameters["compute_counted_on"].default
    return COMPUTE_COUNTED_ON[variant.module.get("compute_counted_on", default)]


def recipe_digest(variant: Variant, decay_over: str = "steps") -> str:
    """What `variant` trains with besides its removal (its router and `training_arguments`: the bench's defaults
    under its own module arguments, a step count where it decays over one) as 12 hex digits of SHA-256, recorded in
    train_info.json: an adapter trained before the recipe changed (e.g. LAYER_HEALING's passes) is stale."""
    recipe = {"router": variant.router, "module": training_arguments(variant, {}, 1.0, decay_over)}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def training_key(variant: Variant, removal: dict[str, Any], decay_over: str = "steps",
                 backbone_weights: str | None = None) -> dict[str, Any]:
    """What a reused adapter of `variant` must have been trained with (its train_info.json): its recipe
    (`recipe_digest`); the removal settings `removal`; the real VLM build `backbone_weights`
    (`real_vlm.weights_digest`: a rebuilt projector gives the teacher other outputs on every image) where given;
    for a decaying variant under
    `decay_over="budget"`, that decay (adapters trained before it decayed over their steps); for a variant pulled
    to a compute target, what that target counted and whether image positions could skip."""
    key = {**removal, "recipe": recipe_digest(variant, decay_over),
           "overrides": None}  # `bench.heal --set` trained another recipe than the variant's
    if backbone_weights is not None:
        key["backbone_weights"] = backbone_weights
    if variant.steps and decay_over == "budget":
        key["decay_over"] = "budget"
    if variant.module.get("compute_target") is None:
        return key
    return {**key, "compute_counted_on": compute_counted_on(variant),
            "skip_image_positions": variant.module.get("skip_image_positions", True)}


def _same(variant: Variant, key: str, recorded: Any, expected: Any) -> bool:
    """Whether a reused adapter's train_info value `recorded` under `key` is the one this run trains with."""
    if key == "removal_order" and variant.removal_target is not None and isinstance(recorded, list):
        # Every step removes all of the order and the adapter is measured at its own target only: the order of its
        # blocks changes nothing (`bench.heal --removal` given them in another order trained the same adapter).
        return sorted(recorded) == sorted(expected)
    return recorded == expected


def stale_runs(variants: list[Variant], runs: Path, expected: dict[str, dict[str, Any]]) -> list[str]:
    """The trained adapters in `runs` that would be reused but were trained otherwise than `expected`
    (`training_key`), e.g. without other blocks than this run removes (an order searched again since): a static
    row would measure blocks its LoRA did not heal."""
    stale = []
    for variant in variants:
        info_path = runs / variant.name / "train_info.json"
        if not info_path.is_file():
            continue
        info = json.loads(info_path.read_text())
        wrong = {k: info.get(k) for k, v in expected[variant.name].items() if not _same(variant, k, info.get(k), v)}
        if wrong:
            stale.append(f"{runs / variant.name}: trained with {wrong}, this run needs "
                         f"{ {k: expected[variant.name][k] for k in wrong} }")
    return stale


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def training_arguments(variant: Variant, removal: dict[str, Any], lr_scale: float = 1.0,
                       decay_over: str = "steps") -> dict[str, Any]:
    """`RetrofitModule` arguments of `variant` (besides backbone, router and dtype): its recipe, the cosine decay
    where it has a step count (over those steps, or with `decay_over="budget"` over no step count: `BudgetDecay`
    drives it), its removal schedule `removal`, the learning rate times `lr_scale`."""
    arguments = {"lr": 5e-3, "warmup_steps": 20, "scheduler": "constant", **variant.module}
    if variant.steps:
        arguments.update(scheduler="cosine", total_steps=variant.steps if decay_over == "steps" else None)
    arguments.update(removal)
    arguments["lr"] *= lr_scale
    return arguments


class BudgetStop(pl.Callback):
    """Ends a run when `seconds` of wall clock have passed since its fit started, so that what the module prepares
    before its first step (a layer replacement's fit: minutes) is spent from the budget (Lightning's `max_time`
    starts at the first step). `sync` waits for the device before the clock is read."""

    def __init__(self, seconds: float, sync=lambda: None, clock=time.perf_counter):
        if seconds <= 0:
            raise ValueError(f"{type(self).__name__} needs a budget > 0 s, got {seconds}")
        self.seconds, self.sync, self.clock = float(seconds), sync, clock
        self.started: float | None = None

    def on_fit_start(self, trainer, module) -> None:
        self.sync()
        self.started = self.clock()

    def on_train_batch_end(self, trainer, *args) -> None:
        self.sync()
        if self.clock() - self.started >= self.seconds:
            trainer.should_stop = True


class BudgetDecay(BudgetStop):
    """The learning rate's decay runs over a wall-clock budget instead of a step count. At each
    step the schedule's progress is the time spent since the fit started over `seconds` (warmup stays in steps), so
    the decay ends with the budget whatever a step costs: on a machine whose speed drifts, or a GPU whose step time
    was never measured, a run sized in steps either stops undecayed at the time cap or leaves the budget unused.

    Built on the module's own schedule (`scheduler`, `warmup_steps`, `min_lr_ratio`); ends the run as `BudgetStop`.
    """

    RESOLUTION = 1_000_000  # steps of the step-based schedule that one budget spans

    def factor(self, warmup, decay):
        """The multiplier of the base learning rate at a step: `warmup(step)` times `decay` at the time spent."""
        def multiplier(step: int) -> float:
            self.sync()
            progress = min(1.0, (self.clock() - self.started) / self.seconds)
            return warmup(step) * decay(round(progress * self.RESOLUTION))
        return multiplier

    def on_train_start(self, trainer, module) -> None:
        from vlm_retrofit.training.optim import lr_lambda

        hp = module.hparams
        if self.started is None:
            self.started = self.clock()
        multiplier = self.factor(lr_lambda("constant", hp.warmup_steps, None, 1.0),
                                 lr_lambda(hp.scheduler, 0, self.RESOLUTION, hp.min_lr_ratio))
        for config in trainer.lr_scheduler_configs:
            config.scheduler.lr_lambdas = [multiplier] * len(config.scheduler.lr_lambdas)


def train_variant(variant: Variant, backbone: str, shards: dict[str, Any], minutes: float, batch_size: int, *,
                  removal: dict[str, Any], runs: Path, device: str = "cpu",
                  dtype: str | None = None, precision: str = "32-true", num_workers: int = 1,
                  lr_scale: float = 1.0, decay_over: str = "steps", seed: int = 0,
                  recorded: dict[str, Any] | None = None) -> dict:
    """Distil one router variant within a wall-clock budget; the adapter lands in `runs`/<name>/adapter.

    Variants evaluated with the static policy train under the removal schedule `removal` (`removal_settings`). A
    variant with a step count decays its learning rate over them (`decay_over="steps"`) or over the budget's wall
    clock (`"budget"`: as many steps as the budget holds, `BudgetDecay`). `seed` seeds the training stream (the
    caller seeds torch for the trained weights' initialisation). `recorded` goes into train_info.json beside what
    the run measured (e.g. `bench.heal --set`'s overrides).
    """
    from vlm_retrofit.datamodules import WebDatasetDataModule
    from vlm_retrofit.training import RetrofitModule

    from .real_vlm import weights_digest

    out = runs / variant.name
    info_path = out / "train_info.json"
    if info_path.is_file():
        return json.loads(info_path.read_text())
    module_args = training_arguments(variant, removal, lr_scale, decay_over)
    module = RetrofitModule(backbone=backbone, model_class="bench.efficientnet_tower.LlavaForConditionalGeneration",
                            router=variant.router, torch_dtype=dtype, **module_args)
    data = WebDatasetDataModule(processor=backbone, train_shards=shards["train"],
                                train_weights=shards.get("train_weights"), val_shards=shards["val"],
                                batch_size=batch_size, num_workers=num_workers, max_length=384, train_samples_per_epoch=100000,
                                add_quality_callback=True, seed=seed)
    timings: list[float] = []
    kl_curve: list[float] = []

    cuda = device.startswith("cuda")

    def sync() -> None:  # CUDA kernels run asynchronously: a step's wall clock must wait for them
        if cuda:
            torch.cuda.synchronize()

    class StepTimer(pl.Callback):
        def on_train_batch_start(self, *args):
            sync()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            sync()
            timings.append(time.perf_counter() - self.start)
            metrics = trainer.callback_metrics
            if not float(metrics.get("train/dense_step", 0.0)):  # a dense step leaves train/kl as it was
                kl = metrics.get("train/kl")
                kl_curve.append(float(kl) if kl is not None else float("nan"))

    by_budget = bool(variant.steps) and decay_over == "budget"
    budget = BudgetDecay(minutes * 60, sync) if by_budget else BudgetStop(minutes * 60, sync)
    callbacks = [StepTimer(), budget]
    trainer = pl.Trainer(max_time={"minutes": minutes}, max_steps=module_args.get("total_steps") or 100000,
                         limit_val_batches=0, logger=False,
                         accelerator="gpu" if cuda else "cpu", devices=1, precision=precision,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=callbacks,
                         default_root_dir=out, log_every_n_steps=10)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    fit_started = time.perf_counter()
    trainer.fit(module, data)
    fit_seconds = time.perf_counter() - fit_started
    module.save_adapter(out / "adapter")
    steady = timings[5:] or timings
    info = {"steps": trainer.global_step, "minutes": minutes, "batch_size": batch_size, "lr": module_args["lr"],
            "schedule": (f"cosine to 0.1x over the {minutes:g}-min budget's wall clock" if by_budget
                         else f"cosine to 0.1x over {variant.steps} steps" if variant.steps else module_args["scheduler"]),
            **({"decay_over": "budget"} if by_budget else {}),
            "fit_seconds": round(fit_seconds, 1),
            **({"replacement_fit_seconds": round(module.replacement_fit_seconds, 1),
                "replacement": {k: module.hparams[k] for k in ("replacement", "replacement_batches",
                                                               "replacement_epochs", "replacement_lr",
                                                               "replacement_inputs")}}
               if module.replacement_fit_seconds is not None else {}),
            "removal_order": module.adapter.removal_order, "max_removed_blocks": module.hparams.max_removed_blocks,
            "min_removed_blocks": module.hparams.min_removed_blocks,
            "query_lr_scale": module.hparams.query_lr_scale, "distill_positions": module.hparams.distill_positions,
            "train_routers": module.hparams.train_routers, "recipe": recipe_digest(variant, decay_over),
            **({"lora": dict(module.hparams.lora)} if module.hparams.lora else {}),
            **({"compute_counted_on": compute_counted_on(variant), "skip_image_positions": module.adapter.skip_image_positions}
               if module.hparams.compute_target is not None else {}),
            "device": device, "dtype": dtype or "float32", "precision": precision,
            "backbone_weights": weights_digest(backbone),
            "step_seconds": sum(steady) / max(1, len(steady)), "peak_rss_mb": _peak_rss_mb(),
            **({"peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)} if cuda else {}),
            # Mean training KL per tenth of the run (the removal prefix is random per step: read the trend).
            "kl_curve": [sum(part) / len(part) for part in (kl_curve[i * len(kl_curve) // 10:(i + 1) * len(kl_curve) // 10]
                                                           for i in range(10)) if part],
            "final_metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
            **(recorded or {})}
    info_path.write_text(json.dumps(info, indent=2))
    return info


def training_precision(device: str, precision: str | None = None, frozen_dtype: str | None = None,
                       otherwise_dtype: str | None = None) -> tuple[str, str | None]:
    """The training steps' precision and the frozen weights' dtype (None: float32), as `train_variant` takes them.

    `precision` defaults to bf16-mixed where `device` has fast bf16 kernels, else 32-true; `frozen_dtype` to bfloat16
    under bf16-mixed, else `otherwise_dtype`.
    """
    precision = precision or ("bf16-mixed" if fast_bf16(device) else "32-true")
    dtype = frozen_dtype or ("bfloat16" if precision == "bf16-mixed" else otherwise_dtype)
    return precision, None if dtype == "float32" else dtype


def training_shards(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the variants train and validate on, from the shards' manifest (`write_bench_shards`): drawn per sample,
    27 % captions and 73 % Austen (the share the fifteenth run's pooled shards gave on average)."""
    return {"train": [manifest["shards"]["captions-train"]["dir"], manifest["shards"]["austen-train"]["dir"]],
            "train_weights": [0.27, 0.73], "val": manifest["shards"]["captions-val"]["dir"]}
