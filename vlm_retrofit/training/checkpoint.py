"""RetrofitCheckpoint: Lightning's ModelCheckpoint that never loses the final steps of a run."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


class RetrofitCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that also saves when training ends on a step it has not saved yet.

    Lightning's own callback saves `last.ckpt` only on its step / epoch triggers, so a run whose `max_steps`
    is not a multiple of `every_n_train_steps` (or that stopped early) would resume from an older step.
    Checkpoints hold only the trainable state (see `RetrofitModule.on_save_checkpoint`).
    """

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            if self.monitor is None or self.monitor in candidates:
                self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)
