"""Checkpoints of a retrofit run: their vlm_retrofit section, its checks on resume, and a ModelCheckpoint that
never loses the final steps."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from ..errors import InputError
from ..replacement import replacement_kind
from ..routing import AdapterMismatchError, check_fingerprint
from ..routing.adapter import check_layout

if TYPE_CHECKING:
    from .module import RetrofitModule

#: Key of the vlm_retrofit section in a Lightning checkpoint dict.
CHECKPOINT_KEY = "vlm_retrofit"
CHECKPOINT_FORMAT = 1


def checkpoint_metadata(module: "RetrofitModule") -> dict[str, Any]:
    """What a checkpoint of `module` records besides its trainable tensors."""
    return {
        "format_version": CHECKPOINT_FORMAT,
        "backbone": module.adapter.base_model["name"],  # a local folder as an absolute path (`recorded_name`)
        # How the removal order was ranked (impact / joint / span), when the run ranked it: a resume keeps it.
        "removal_order_mode": module.hparams.removal_order if isinstance(module.hparams.removal_order, str) else None,
        "base_fingerprint": dict(module.adapter.fingerprint),
        "router_config": module.adapter.config.to_dict(),
        "layout": module.adapter.layout.to_dict(),
        "lora": module.hparams.lora,
        **module.adapter.training_record(),
        "replacements": None if module.replacements is None else {str(k): v for k, v in module.replacements.items()},
        "replacement_layers": None if module.replacements is None else module.replacement_layers(),
        "trainable_keys": sorted(module.trainable_keys()),
        "nonfinite_steps": module.nonfinite_steps,
        "nonfinite_streak": module.nonfinite_streak,
    }


def check_checkpoint(module: "RetrofitModule", checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Refuse a checkpoint made for another base model or another set of trainable parameters, naming the
    differences; warn when only the router config differs. Returns its vlm_retrofit section."""
    meta = checkpoint.get(CHECKPOINT_KEY)
    if meta is None:
        raise AdapterMismatchError("this checkpoint was not written by vlm_retrofit's RetrofitModule (it has no "
                                   f"'{CHECKPOINT_KEY}' section); refusing to load it")
    adapter = module.adapter
    check_fingerprint(meta["base_fingerprint"], adapter.fingerprint, projections=True,  # the module's base: unmerged
                      source=f"checkpoint for backbone {meta.get('backbone')!r}")
    if meta.get("router_config") == adapter.config.to_dict():  # another router config is warned about below
        check_layout(meta.get("layout"), adapter.layout, source="checkpoint")
    state = checkpoint.get("state_dict", {})
    trainable = module.trainable_keys()
    expected = {k: v for k, v in module.state_dict().items() if k in trainable}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or shapes:
        saved_cfg, cfg = meta.get("router_config"), adapter.config.to_dict()
        differs = {k: (saved_cfg.get(k), cfg.get(k)) for k in cfg if saved_cfg and saved_cfg.get(k) != cfg.get(k)}
        saved_routers, routers = (any(k.startswith("adapter.") for k in keys) for keys in (state, expected))
        if saved_routers != routers:  # the likeliest cause, named before the key lists
            raise AdapterMismatchError(
                f"this checkpoint {'trained' if saved_routers else 'did not train'} the routers and this run "
                f"{'trains' if routers else 'does not train'} them (train_routers: {str(routers).lower()}): resume "
                f"with train_routers: {str(saved_routers).lower()}, or start a new run (fit without --ckpt_path)")
        raise AdapterMismatchError(
            "checkpoint does not match this module's trainable parameters: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)}), "
            f"wrong shape {shapes[:8]}. Router config differences (saved, now): {differs or 'none'}; "
            f"LoRA saved {meta.get('lora')!r}, now {module.hparams.lora!r}."
        )
    saved_lora, lora = dict(meta.get("lora") or {}), dict(module.hparams.lora or {})
    lora_changes = {k for k in saved_lora.keys() | lora.keys() if saved_lora.get(k) != lora.get(k)}
    if lora_changes & LORA_SCALE_FIELDS:
        changed = ", ".join(f"{k} {saved_lora.get(k)!r} -> {lora.get(k)!r}" for k in sorted(lora_changes & LORA_SCALE_FIELDS))
        raise AdapterMismatchError(
            f"resuming with a LoRA that scales its update otherwise than the checkpoint's ({changed}): the trained "
            "matrices would compute another function. Resume with the checkpoint's LoRA settings, or start a new run "
            "(fit without --ckpt_path)")
    if lora_changes:
        rank_zero_warn(f"resuming with LoRA settings {sorted(lora_changes)} other than the checkpoint's: saved "
                       f"{meta.get('lora')}, now {module.hparams.lora}")
    if meta.get("router_config") != adapter.config.to_dict():
        rank_zero_warn(f"resuming with a different router config than the checkpoint's: saved "
                       f"{meta.get('router_config')}, now {adapter.config.to_dict()}")
    _check_removal(meta, module.hparams)
    return meta


def _check_removal(meta: dict[str, Any], hparams: Any) -> None:
    """Refuse a resume that would heal another removal than the checkpoint's: a resumed run keeps its order."""
    start_over = "or start a new run (fit without --ckpt_path)"
    if meta.get("replacements") is None and hparams.replace_removed:
        raise AdapterMismatchError(
            "this checkpoint healed its removal without a linear replacement and this run asks for one "
            "(replace_removed: true): fitted now, it would change the model under a LoRA trained without it. "
            f"Resume without replace_removed, {start_over}")
    if meta.get("replacements") and hparams.replace_removed:
        saved_kind = replacement_kind(meta["replacements"])
        if saved_kind != hparams.replacement:
            raise AdapterMismatchError(
                f"this checkpoint healed its removal with a {saved_kind} replacement and this run asks for a "
                f"{hparams.replacement} one. Resume with replacement: {saved_kind}, {start_over}")
    saved_order, saved_mode, given = meta.get("removal_order"), meta.get("removal_order_mode"), hparams.removal_order
    if isinstance(saved_mode, str) and isinstance(given, str) and saved_mode != given:
        raise AdapterMismatchError(
            f"this checkpoint ranked its removal order by {saved_mode!r} and this run says {given!r}: a resumed run "
            f"keeps the order it started with ({saved_order}). Resume with removal_order: {saved_mode}, {start_over}")
    if saved_order is not None and isinstance(given, (list, tuple)) and list(given) != list(saved_order):
        raise AdapterMismatchError(
            f"this checkpoint healed removal order {saved_order} and this run names {list(given)}: a resumed run "
            f"keeps the removal it started with. Resume without removal_order, {start_over} to heal another removal")


OPTIMIZER_STATE_FIELDS = ("optimizer", "lr", "query_lr_scale", "lora_b_lr_scale", "weight_decay", "optimizer_kwargs")
"""RetrofitModule settings a resumed fit takes from the checkpoint's optimizer and scheduler state (their
learning rates, weight decay, betas) whatever this run says; the schedule's shape (warmup, decay, floor) is not
stored and follows this run."""


def _optimizer_setting(key: str, value: Any) -> Any:
    """A setting in a form that compares by meaning: no kwargs = {}, an optimizer name = its class."""
    if key == "optimizer_kwargs":
        return dict(value or {})
    if key == "optimizer" and isinstance(value, str):
        from .optim import optimizer_class

        with contextlib.suppress(Exception):  # unknown here: compared by name
            return optimizer_class(value)
    return value


def check_optimizer_settings(saved: dict[str, Any], hparams: Any) -> None:
    """Refuse to resume a fit with optimizer settings other than the checkpoint's: its restored state would set
    the learning rates and the rest back, and the run would ignore them silently."""
    changed = {k: (saved[k], hparams.get(k)) for k in OPTIMIZER_STATE_FIELDS
               if k in saved and _optimizer_setting(k, saved[k]) != _optimizer_setting(k, hparams.get(k))}
    if changed:
        details = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
        raise AdapterMismatchError(
            f"resuming with optimizer settings other than the checkpoint's ({details}): the restored optimizer and "
            "learning-rate schedule would keep the checkpoint's. Resume with its settings, or start a new run (fit "
            "without --ckpt_path)")


LORA_SCALE_FIELDS = frozenset({"lora_alpha", "use_rslora", "use_dora", "alpha_pattern", "rank_pattern"})
"""LoRA settings that change what trained LoRA matrices compute (their update's scale or form)."""


def resumed_removal_range(saved: tuple[int, int], now: tuple[int, int] | None) -> tuple[int, int]:
    """The removal counts a run resumed from a checkpoint has trained: the checkpoint's `saved` range (min, max
    removed blocks) and this run's `now` (None: this run removes nothing, so the saved range stands). A different
    range is recorded as the span of both and warned about; two ranges with a gap between them are refused, since
    one range would claim the counts in the gap, which neither run trained (a pruned release of them would pass
    `untrained_removal`)."""
    if now is None or now == saved:
        return saved
    low, high = sorted([saved, now])
    if high[0] > low[1] + 1:
        raise AdapterMismatchError(
            f"this checkpoint trained removals of {saved[0]}..{saved[1]} blocks and this run's min_removed_blocks / "
            f"max_removed_blocks say {now[0]}..{now[1]}: no range records both, and a release pruning a count between "
            "them would pass as trained. Resume with a schedule that overlaps or adjoins the checkpoint's, or start a "
            "new run (fit without --ckpt_path)")
    merged = (min(saved[0], now[0]), max(saved[1], now[1]))
    rank_zero_warn(f"resuming with removal schedule {now[0]}..{now[1]} blocks over a checkpoint trained on "
                   f"{saved[0]}..{saved[1]}: the adapter records {merged[0]}..{merged[1]} as trained")
    return merged


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """The vlm_retrofit section of a checkpoint plus its trainable tensor names, sizes and the file size."""
    path = Path(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    meta = dict(checkpoint.get(CHECKPOINT_KEY) or {})
    state = checkpoint.get("state_dict", {})
    meta["tensors"] = {k: tuple(v.shape) for k, v in state.items()}
    meta["parameters"] = int(sum(v.numel() for v in state.values()))
    meta["global_step"] = checkpoint.get("global_step")
    meta["file_bytes"] = path.stat().st_size
    return meta


def use_run_folder(callback: ModelCheckpoint, trainer: "pl.Trainer") -> None:
    """Give a checkpoint callback without a `dirpath` the run's folder, `<trainer.default_root_dir>/checkpoints`."""
    if callback.dirpath is None:
        callback.dirpath = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))


class NothingToResumeError(InputError, FileNotFoundError):
    """`--ckpt_path last` where the checkpoint folder holds checkpoints but no `last.ckpt` (`fit`), or none at all
    (`validate`, `test`, `predict`)."""


def _without_last(trainer: "pl.Trainer") -> list[ModelCheckpoint] | None:
    """The trainer's checkpoint callbacks where none of them finds a `last.ckpt` (what `--ckpt_path last` reads);
    None where one does."""
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    return None if any(c._find_last_checkpoints(trainer) for c in callbacks) else callbacks


def check_nothing_to_resume_is_missed(trainer: "pl.Trainer") -> None:
    """Refuse `--ckpt_path last` where no `last.ckpt` exists but the checkpoint folders hold other checkpoints.

    Lightning then starts from step 0 with a warning: right for a first run, wrong for a run whose checkpoint
    callback does not save `last.ckpt` (Lightning's own default, taken when `trainer.callbacks` lists none).
    """
    callbacks = _without_last(trainer)
    if callbacks is None:
        return
    found = sorted((p for c in callbacks if c.dirpath and os.path.isdir(c.dirpath) for p in Path(c.dirpath).glob("*.ckpt")),
                   key=lambda p: p.stat().st_mtime)
    if found:
        raise NothingToResumeError(
            f"--ckpt_path last: no last.ckpt in {', '.join(sorted({str(p.parent) for p in found}))}, which holds "
            f"{len(found)} other checkpoint(s), the newest {found[-1]}; resuming would start over from step 0. "
            "Give that file as --ckpt_path, and a checkpoint callback with save_last: true (as "
            "vlm_retrofit.training.RetrofitCheckpoint, the default, has) to resume by `last`")


def check_last_to_evaluate(trainer: "pl.Trainer", command: str) -> None:
    """Refuse `validate/test/predict --ckpt_path last` where no checkpoint callback finds a `last.ckpt`: Lightning
    then evaluates the routers as initialised, with a warning only, and `predict` writes their figures."""
    callbacks = _without_last(trainer)
    if callbacks is None:
        return
    folders = sorted({str(c.dirpath) for c in callbacks if c.dirpath}) or [str(Path(trainer.default_root_dir))]
    raise NothingToResumeError(
        f"{command} --ckpt_path last: no last.ckpt in {', '.join(folders)}, so nothing trained to evaluate. Give a "
        "checkpoint file as --ckpt_path (or the --trainer.default_root_dir of the run), or drop --ckpt_path to "
        "evaluate the routers as initialised")


def stop_after_this_step(trainer: "pl.Trainer") -> None:
    """Stop at the end of this step, even short of `min_steps` / `min_epochs` (Lightning would run on to them)."""
    trainer.should_stop = True
    trainer.fit_loop.min_epochs = None
    trainer.fit_loop.epoch_loop.min_steps = None


class RetrofitCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that also saves when training ends on a step it has not saved yet.

    Lightning's own callback saves `last.ckpt` only on its step / epoch triggers, so a run whose `max_steps`
    is not a multiple of `every_n_train_steps` (or that stopped early) would resume from an older step.
    Checkpoints hold only the trainable state (see `RetrofitModule.on_save_checkpoint`).

    Without a `dirpath` they go to `<trainer.default_root_dir>/checkpoints`, beside the exported adapter: a run
    given another root (`--trainer.default_root_dir`) then neither overwrites another run's `last.ckpt` nor resumes
    from it. (Lightning's own default is the logger's version folder, where `--ckpt_path last` of the next
    version would not look.) `python -m vlm_retrofit` sets it as the trainer is built, before `--ckpt_path last`
    is looked up; in a trainer of your own it is set at setup.

    Stopping saves too: a SIGTERM (Lightning stops at the end of the step) or a first Ctrl-C during `fit`, which
    this callback turns into the same stop at the end of the step (`interrupted`); a second Ctrl-C stops at once,
    unsaved, as Lightning does. A Ctrl-C handler of your own is left alone.
    """

    interrupted = False
    """Whether a Ctrl-C stopped this callback's last `fit`."""
    terminated = False
    """Whether this process received a SIGTERM during its last multi-process `fit`."""
    _stop_reported = False
    _previous_sigint: Any = None

    def use_run_folder(self, trainer: "pl.Trainer") -> None:
        """Take `<trainer.default_root_dir>/checkpoints` as the folder, unless one was given."""
        use_run_folder(self, trainer)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.use_run_folder(trainer)
        super().setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Here, not at fit start: Lightning takes every signal handler it finds when training starts back at its
        # teardown, which would re-install this one after the run.
        super().on_train_start(trainer, pl_module)
        self.interrupted = self.terminated = self._stop_reported = False
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_sigint = signal.signal(signal.SIGINT, lambda signum, frame: self._on_ctrl_c(trainer))
        if trainer.world_size > 1:
            # Lightning's own SIGTERM handler broadcasts from inside the signal handler, wherever the step is: with
            # the signal on every rank (a pre-empted job) or on one other than rank 0, the ranks then wait in
            # different collectives and hang or abort, unsaved. Here the handler only takes note; the ranks agree at
            # the end of the step (`on_train_batch_end`) and stop there together, saved. Lightning's teardown puts
            # back the handler that was there before the run.
            signal.signal(signal.SIGTERM, lambda signum, frame: self._on_sigterm(trainer, signum))

    def _on_sigterm(self, trainer: "pl.Trainer", signum: int) -> None:
        if not self.terminated and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # the process that started the others passes it on, as Lightning
        self.terminated = True

    def _on_ctrl_c(self, trainer: "pl.Trainer") -> None:
        if self.interrupted:
            raise KeyboardInterrupt  # the second one: Lightning's own interrupt, nothing saved
        self.interrupted = True
        stop_after_this_step(trainer)
        if trainer.is_global_zero:
            print("\nCtrl-C: stopping at the end of this step and saving it, after the validation Lightning runs on "
                  "stopping (Ctrl-C again stops at once, unsaved)", file=sys.stderr, flush=True)

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._restore_sigint()
        super().on_exception(trainer, pl_module, exception)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._restore_sigint()
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            if self.monitor is None or self.monitor in candidates:
                self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any,
                           **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if trainer.world_size > 1:
            # Every rank stops, and saves (a collective), at the same step: one rank's terminal may take the Ctrl-C
            # a step before another's, or alone; a SIGTERM reaches the ranks at different moments, or one alone.
            if trainer.strategy.reduce_boolean_decision(self.interrupted, all=False) and not self.interrupted:
                self.interrupted = True
                stop_after_this_step(trainer)
            if trainer.strategy.reduce_boolean_decision(self.terminated, all=False):
                self.terminated = True
                trainer._signal_connector.received_sigterm = True  # Lightning then stops after this step, everywhere
        # A SIGTERM (a pre-empted or time-limited job) or a Ctrl-C makes Lightning stop at the end of this step: save
        # it here, where the periodic checkpoints are saved (a save from the stop itself would hold a state Lightning
        # does not resume exactly), or every step since the last periodic checkpoint is lost.
        if (trainer.received_sigterm or self.interrupted) and not self._stop_reported:
            if not self._should_skip_saving_checkpoint(trainer):  # it skips a step a periodic save just wrote
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            if self._last_global_step_saved != trainer.global_step:
                return  # nothing saved (fast_dev_run): nothing to report
            self._stop_reported = True
            cause = "SIGTERM" if trainer.received_sigterm else "Ctrl-C"
            saved = self.last_model_path or self._last_checkpoint_saved
            rank_zero_warn(f"stopped by {cause} at step {trainer.global_step}: saved {saved}; "
                           "`--ckpt_path last` resumes from it")
