"""Command line: `python -m vlm_retrofit <subcommand> ...`, callable in-process as `main([...])`.

* `fit`, `validate`, `test`, `predict`: Lightning's CLI over `RetrofitModule` and a datamodule (default
  `WebDatasetDataModule`). With no options, `fit` runs the built-in tiny default (what `configs/tiny.yaml`
  spells out): a tiny offline backbone on synthetic shards, about a minute on a CPU.
* other subcommands (`shards`, and `calibrate` / `generate` / `merge` where installed) have their own parsers.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import InputError

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")

# Subcommands implemented outside this file, imported only when used so `--help` stays fast.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "shards": ("vlm_retrofit.datamodules.shards", "main"),
    "calibrate": ("vlm_retrofit.commands", "calibrate_main"),
    "generate": ("vlm_retrofit.commands", "generate_main"),
    "merge": ("vlm_retrofit.release", "main"),
}

DATAMODULE = "vlm_retrofit.datamodules.webdataset.WebDatasetDataModule"
RUN_DIR = "runs/tiny"
"""Where the built-in default run writes checkpoints (`<RUN_DIR>/checkpoints/last.ckpt`), logs and the adapter."""

# The built-in default run. configs/tiny.yaml spells out the same values (a test keeps them identical).
# Model settings that differ from RetrofitModule's own defaults: learned skip gates pulled to 75 % compute.
MODEL_DEFAULTS: dict[str, Any] = {
    "router.skip_gate": True,
    "compute_target": 0.75,
    "max_drop_rate": 0.0,
    "lr": 0.05,
}
DATA_DEFAULTS: dict[str, Any] = {
    "batch_size": 4,
    "num_workers": 1,
    "max_length": 256,
    "train_samples_per_epoch": 160,
    "synthetic_samples": 256,
}
CHECKPOINT_DEFAULTS: dict[str, Any] = {
    "filename": "step{step:06d}",
    "auto_insert_metric_name": False,
    "save_last": True,
    "every_n_train_steps": 20,
    "enable_version_counter": False,
}
GENERATION_CALLBACK_DEFAULTS: dict[str, Any] = {
    "max_samples": 8,
    "max_new_tokens": 16,
    "policy": None,  # the model's: gate where the routers have skip gates (the default run's do), else recent_weight
    "target_saving": 0.25,
}
TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 40,
    "log_every_n_steps": 1,
    "limit_val_batches": 4,
    "num_sanity_val_steps": 1,  # one val batch before the first step: unusable val_shards are refused up front
    "default_root_dir": RUN_DIR,
}


def _available(name: str) -> bool:
    module, _ = SUBCOMMANDS[name]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _load(name: str) -> Callable[[list[str]], int | None]:
    module, attr = SUBCOMMANDS[name]
    return getattr(importlib.import_module(module), attr)


def _commands() -> list[str]:
    return [*LIGHTNING_SUBCOMMANDS, *(name for name in SUBCOMMANDS if _available(name))]


def _usage() -> str:
    return (
        "usage: python -m vlm_retrofit {" + ",".join(_commands()) + "} [options]  (see <subcommand> --help)\n"
        "  fit       train the depth routers by self-distillation (no options: the built-in tiny demo;\n"
        "            --config configs/<name>.yaml for a real backbone; --ckpt_path last resumes)\n"
        "  validate / test / predict   evaluate a checkpoint (--ckpt_path) with the same config\n"
        "  shards    write WebDataset shards from images + captions, a JSONL file, or synthetic samples\n"
        "  calibrate set skip thresholds for target savings on calibration shards; store them with the adapter\n"
        "  generate  answer a prompt (and an image) with skipping; report the compute saved\n"
        "  merge     write a release folder from a checkpoint or adapter (--prune-target: a pruned, plain model)"
    )


def _lightning_cli_class():
    from jsonargparse import lazy_instance, set_parsing_settings
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI

    from .training import RetrofitCheckpoint, RetrofitModule, RunCSVLogger
    from .training.checkpoint import check_last_to_evaluate, check_nothing_to_resume_is_missed, use_run_folder

    # RouterConfig documents its fields as attribute docstrings: without this, `--model.router.*` had no help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)

    class RetrofitCLI(LightningCLI):
        """LightningCLI with the built-in default run and the backbone -> processor, model -> data seed links."""

        def add_arguments_to_parser(self, parser) -> None:
            # The datamodule formats text with the backbone's own processor: one setting for both.
            # (LINKED_DATA_ARGUMENTS names both links.)
            parser.link_arguments("model.backbone", "data.init_args.processor")
            # One seed for the skip sampling and the data stream: Lightning refuses to log two values of `seed`.
            parser.link_arguments("model.seed", "data.init_args.seed")
            parser.set_defaults({
                **{f"model.{key}": value for key, value in MODEL_DEFAULTS.items()},
                "data": {"class_path": DATAMODULE, "init_args": dict(DATA_DEFAULTS)},
                # The checkpoint callback comes last: `--trainer.callbacks.<arg>` edits the last entry.
                "trainer.callbacks": [{"class_path": "vlm_retrofit.callbacks.SkipAwareGenerationCallback",
                                       "init_args": dict(GENERATION_CALLBACK_DEFAULTS)},
                                      {"class_path": "vlm_retrofit.training.RetrofitCheckpoint",
                                       "init_args": dict(CHECKPOINT_DEFAULTS)}],
                "trainer.logger": lazy_instance(RunCSVLogger, name="logs"),
            })

        def parse_arguments(self, parser, args) -> None:
            argv = sys.argv[1:] if args is None else args
            self.settings_given = {part: gives_settings(argv, part) for part in ("model", "data")}
            super().parse_arguments(parser, args)

        def _parse_ckpt_path(self) -> None:
            # Lightning writes a checkpoint's hyperparameters over the parsed config, whatever the user set: a
            # model setting given in --config or on the command line was dropped silently, and the resume checks
            # compared the checkpoint with itself. Here a checkpoint file rebuilds its model, and its datamodule,
            # only where the user gave no settings for it at all (`validate --ckpt_path X`: before, that validated X
            # on the built-in synthetic shards whatever X was trained on); otherwise what the user set stands and
            # the checkpoint's load refuses what it cannot take (`check_checkpoint`: another base, router layout...).
            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if not ckpt_path or lightning_checkpoint_name(ckpt_path):
                return  # resolved by Lightning once the trainer is built
            recorded = read_hyperparameters(ckpt_path)
            restored = {part: settings for part, settings in recorded.items()
                        if settings and not self.settings_given[part]}
            if restored:
                self.config = self.parser.parse_object({subcommand: restored}, self.config)
                print(f"{subcommand}: the {' and '.join(restored)} settings come from {ckpt_path} (none were given)",
                      file=sys.stderr)

        def instantiate_trainer(self, **kwargs: Any):
            trainer = super().instantiate_trainer(**kwargs)
            # Before `--ckpt_path last` is looked up (Lightning does that before any callback's setup), and before
            # the loggers make their folders: checkpoints and logs follow `--trainer.default_root_dir`.
            # Without ours (`trainer.callbacks` replaced), Lightning's own or the user's take the run's folder too, so
            # `--ckpt_path last` looks where they save; beside ours, another callback keeps its own folder.
            callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
            ours = [c for c in callbacks if isinstance(c, RetrofitCheckpoint)]
            for callback in ours or callbacks:
                use_run_folder(callback, trainer)
            for logger in trainer.loggers:
                if isinstance(logger, RunCSVLogger):
                    logger.use_run_folder(trainer)
            return trainer

        def before_fit(self) -> None:
            _warn_about_slow_bf16(self.trainer, self.model)
            if self.config_init[self.subcommand].get("ckpt_path") == "last":
                check_nothing_to_resume_is_missed(self.trainer)

        def after_fit(self) -> None:
            _report_fit(self.trainer, self.model)

        def before_validate(self) -> None:
            _warn_about_slow_bf16(self.trainer, self.model)
            ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
            if ckpt_path == "last":
                check_last_to_evaluate(self.trainer, self.subcommand)
            _warn_without_checkpoint(ckpt_path, self.subcommand)

        before_test = before_predict = before_validate

        def after_predict(self) -> None:
            _report_predictions(self.trainer)

    return RetrofitCLI, RetrofitModule


def input_error(error: BaseException) -> InputError | None:
    """The `InputError` that `error` is or was raised from (`raise ... from`: jsonargparse wraps what a subclass's
    `__init__` raises in its own ValueError), if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, InputError):
            return current
        seen.add(id(current))
        current = current.__cause__  # not __context__: a bug raised while handling a refusal keeps its traceback
    return None


def refusal_text(refusal: BaseException) -> str:
    """A refusal's message; for one raised in a DataLoader worker, the original message alone (torch re-raises it in
    the main process as "Caught X in DataLoader worker process N. Original Traceback ... X: message")."""
    text = str(refusal)
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    name = f"{type(refusal).__name__}: "
    return last.split(name, 1)[1] if name in last else last


def read_hyperparameters(ckpt_path: str) -> dict[str, dict[str, Any]]:
    """The init arguments a Lightning checkpoint recorded, as config sections: "model" (the module's) and "data"
    (the datamodule's class and arguments, less those linked from the model's); a section it did not record is
    empty. A path that is not a checkpoint file is refused naming what it is."""
    import pickle

    import torch

    path = Path(ckpt_path)
    if path.is_dir():
        raise InputError(f"--ckpt_path {ckpt_path} is a folder: give a checkpoint file (<run>/checkpoints/*.ckpt) or "
                         "'last'. An adapter or release folder is read by calibrate, generate and merge (--model)")
    if not path.is_file():
        raise InputError(f"--ckpt_path {ckpt_path}: no such file. Give a checkpoint file (<run>/checkpoints/*.ckpt) "
                         "or 'last' (the run's latest, under --trainer.default_root_dir)")
    try:
        checkpoint = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        # torch's own message advises weights_only=False, which runs whatever code the file holds: not repeated.
        raise InputError(f"--ckpt_path {ckpt_path} is not a Lightning checkpoint this package can read safely (a "
                         "torch file of tensors and plain values, as `fit` writes under <run>/checkpoints)") from error
    if not isinstance(checkpoint, dict):
        raise InputError(f"--ckpt_path {ckpt_path} is not a Lightning checkpoint (it holds a "
                         f"{type(checkpoint).__name__})")
    model = dict(checkpoint.get("hyper_parameters") or {})
    model.pop("_instantiator", None)
    data = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    data.pop("_instantiator", None)
    class_path = data.pop("_class_path", None)
    # The processor and the seed follow the model's settings (links): the parser refuses them given directly.
    init_args = {key: value for key, value in data.items() if key not in LINKED_DATA_ARGUMENTS}
    return {"model": model, "data": {"class_path": class_path, "init_args": init_args} if class_path else {}}


LINKED_DATA_ARGUMENTS = ("processor", "seed")
"""Datamodule arguments the command line sets from the model's (`model.backbone`, `model.seed`)."""


def gives_settings(argv: Sequence[str] | Any, part: str) -> bool:
    """Whether command-line arguments set `part` ("model", "data"): a --config file (which may hold that section)
    or any --<part>.* option (`fit` without them runs the built-in default)."""
    if not isinstance(argv, (list, tuple)):
        return True  # a dict or Namespace given in Python
    return any(a in ("-c", "--config", f"--{part}") or a.startswith(("--config=", f"--{part}.", f"--{part}="))
               for a in map(str, argv))


def lightning_checkpoint_name(ckpt_path: str) -> bool:
    """Names Lightning resolves itself ("last", "best", "hpc", the model registry's) and remote paths, which
    have no local file to read before the trainer is built."""
    lowered = ckpt_path.lower()
    return (lowered in ("last", "best", "hpc", "registry") or lowered.startswith("registry:")
            or "://" in ckpt_path)


def _checkpoint_callback(trainer):
    from lightning.pytorch.callbacks import ModelCheckpoint

    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None)


def _warn_without_checkpoint(ckpt_path: str | None, subcommand: str) -> None:
    if ckpt_path is None:  # legitimate (the base at identity is the reference), but easy to do by mistake
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"{subcommand} without --ckpt_path evaluates the routers as initialised (identity: the base "
                       "model), not a trained run; pass --ckpt_path <run>/checkpoints/last.ckpt (or 'last')")


def _warn_about_slow_bf16(trainer, model) -> None:
    from lightning.pytorch.utilities import rank_zero_warn

    from .hardware import slow_bf16_warning

    message = slow_bf16_warning(str(trainer.strategy.root_device), trainer.precision,
                                getattr(model, "hparams", {}).get("torch_dtype"))
    if message:
        rank_zero_warn(message)


def _gathered_predictions(trainer) -> list[list[list[dict]]]:
    """Every process's predictions (rank order), each a list per dataloader of its per-batch dicts. Under DDP each
    process scored its own share of the batches and Lightning keeps them where they were computed: gathered here
    (a collective, so every rank calls it)."""
    import torch.distributed as dist

    predictions = trainer.predict_loop.predictions or []
    loaders = predictions if predictions and isinstance(predictions[0], list) else [predictions]  # per dataloader
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, loaders)
        return gathered
    return [loaders]


def _report_predictions(trainer) -> None:
    """`predict` computed KL and compute per batch: write them, every process's, to <root>/predictions.jsonl and
    print their means (rank zero)."""
    import json

    processes = _gathered_predictions(trainer)
    if trainer.global_rank != 0:
        return
    rows = [{**({"rank": r} if len(processes) > 1 else {}), "dataloader": d, "batch": i, **b}
            for r, loaders in enumerate(processes) for d, loader in enumerate(loaders) for i, b in enumerate(loader)]
    batches = [b for loaders in processes for loader in loaders for b in loader]
    path = Path(trainer.default_root_dir) / "predictions.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokens = sum(b["tokens"] for b in batches)
    if not tokens:
        print(f"vlm_retrofit predict: no scored tokens in {len(batches)} batches; wrote {path}", flush=True)
        return
    mean = {k: sum(b[k] * b["tokens"] for b in batches) / tokens for k in ("kl", "compute_realised")}
    share = f" from {len(processes)} processes" if len(processes) > 1 else ""
    print(f"vlm_retrofit predict: {len(batches)} batches{share}, {tokens} scored tokens: KL to the frozen model "
          f"{mean['kl']:.4g}, decoder compute realised {mean['compute_realised']:.3f} (skips sampled as in training); "
          f"per batch in {path}", flush=True)


def _report_fit(trainer, model) -> None:
    """What the run saved and achieved (rank zero only)."""
    if trainer.global_rank != 0:
        return
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    lines = [f"vlm_retrofit fit: {trainer.global_step} optimizer steps on {model.hparams.backbone}"]
    callback = _checkpoint_callback(trainer)
    last = getattr(callback, "last_model_path", "") or ""
    best = getattr(callback, "best_model_path", "") or ""
    if last and os.path.isfile(last):
        lines.append(f"  checkpoint {last} ({os.path.getsize(last) / 1024:.1f} KiB: trainable state, optimizer and "
                     "loop state; `--ckpt_path last` resumes)")
    if best and best != last and os.path.isfile(best):
        lines.append(f"  checkpoint {best} ({os.path.getsize(best) / 1024:.1f} KiB)")
    interrupted = any(getattr(c, "interrupted", False) for c in trainer.callbacks)
    if interrupted:  # a partly trained adapter must not replace a finished run's
        lines.append("  stopped by Ctrl-C: the router adapter is not exported; `--ckpt_path last` resumes the run")
    elif not trainer.fast_dev_run:
        adapter_dir = Path(trainer.default_root_dir) / "adapter"
        model.save_adapter(adapter_dir)
        size = sum(f.stat().st_size for f in adapter_dir.rglob("*") if f.is_file())
        how = ("vlm_retrofit.release.load_trained(path): base, LoRA and routers" if model.hparams.lora else
               "RouterAdapter.from_pretrained(model, path), or load_trained(path) with its base")
        lines.append(f"  router adapter {adapter_dir}/ ({size / 1024:.1f} KiB; load with {how}; `merge` makes a "
                     "release of it)")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    lines.append(f"  trainable parameters {trainable:,} of {total:,} ({100 * trainable / max(1, total):.3f} %)")
    if "train/keep_realised" in metrics:
        candidates = model.adapter.skip_candidates  # the keep ratios are averaged over the blocks that may skip
        kept_over = f"candidate blocks {list(candidates)}" if candidates else "skippable blocks"
        lines.append(
            f"  last step: KL {metrics.get('train/kl', float('nan')):.4g}, drop rate "
            f"{metrics.get('train/drop_rate', float('nan')):.2f}, keep ratio of {kept_over} expected "
            f"{metrics.get('train/keep_expected', float('nan')):.3f} / realised {metrics['train/keep_realised']:.3f}, "
            f"decoder compute realised {metrics.get('train/compute_realised', float('nan')):.3f}"
            + (f" (target {model.hparams.compute_target})" if model.hparams.compute_target is not None else ""))
    if "val/kl" in metrics:
        lines.append(f"  validation (skips sampled as in training, at the full drop rate): KL {metrics['val/kl']:.4g}, "
                     "keep realised "
                     f"{metrics.get('val/keep_realised', float('nan')):.3f}")
    if model.nonfinite_steps:
        lines.append(f"  non-finite steps skipped: {model.nonfinite_steps}")
    if model.stop_reason:
        lines.append(f"  {model.stop_reason}")
    print("\n".join(lines), flush=True)


def run_lightning(argv: list[str] | None):
    """Run LightningCLI on `argv` (a Lightning subcommand first); returns the LightningCLI object."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
    if argv is not None:  # called in-process: sys.argv belongs to the host program (e.g. pytest)
        warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter is intended to run from within")
    cli_class, module_class = _lightning_cli_class()
    return cli_class(
        module_class,
        None,
        subclass_mode_data=True,
        args=argv,
        trainer_defaults=dict(TRAINER_DEFAULTS),
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        seed_everything_default=0,
        parser_kwargs={"prog": "python -m vlm_retrofit"},
    )


def _lightning_main(command: str, args: Sequence[str] | None, argv: list[str]) -> int:
    """`main` for fit / validate / test / predict: Lightning's CLI, with refusals in one line."""
    try:
        cli = run_lightning(None if args is None else argv)  # None: LightningCLI reads sys.argv itself
    except SystemExit as exit_:  # --help, --print_config, parse errors; a run stopped by SIGTERM
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exit_, SIGTERMException):  # raised with no code: not a success
            return 128 + 15
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except Exception as error:
        # Refusals of what the user gave (a setting that cannot work, an unsupported family, shards that cannot
        # be read, a checkpoint that does not fit this run, nothing to resume): one line; anything else is a bug
        # worth its traceback.
        refusal = input_error(error)
        if refusal is None:
            raise
        print(f"{command} {refusal.verb}: {refusal_text(refusal)}", file=sys.stderr)
        return 1
    trainer = getattr(cli, "trainer", None)
    if any(getattr(callback, "interrupted", False) for callback in getattr(trainer, "callbacks", [])):
        return 128 + 2  # stopped by Ctrl-C (the step it stopped at saved): not a success either
    stop_reason = getattr(getattr(cli, "model", None), "stop_reason", None)
    if stop_reason:
        print(stop_reason, file=sys.stderr)
        return 1
    return 0


def _end_process_group() -> None:
    """Close the process group a multi-process run opened (Lightning leaves it open). Left to the interpreter's exit,
    gloo's worker threads outlived it and a finished run could abort there ("terminate called without an active
    exception", exit status -6), once in a test run of DDP predict."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(args: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit status (0 on success)."""
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in LIGHTNING_SUBCOMMANDS:
        try:
            return _lightning_main(command, args, argv)
        finally:
            _end_process_group()
    if command not in SUBCOMMANDS or not _available(command):
        print(f"unknown subcommand {command!r}. {_usage()}", file=sys.stderr)
        return 2
    try:
        status = _load(command)(rest)
    except SystemExit as exit_:  # argparse --help / errors
        status = exit_.code
    except (InputError, FileNotFoundError, FileExistsError) as error:
        # What the user gave does not fit (a setting, a missing or moved file, an adapter for another base, an
        # unregistered family): said in one line, as merge does; anything else is a bug worth its traceback.
        print(f"{command} refused: {error}", file=sys.stderr)
        return 1
    return status if isinstance(status, int) else (0 if status is None else 1)
