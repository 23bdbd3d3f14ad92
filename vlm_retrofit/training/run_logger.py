"""RunCSVLogger: Lightning's CSV logger writing under the run's own folder (`trainer.default_root_dir`)."""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import CSVLogger


class RunCSVLogger(CSVLogger):
    """`CSVLogger` whose folder defaults to the trainer's `default_root_dir`.

    A run given another `--trainer.default_root_dir` then writes its metrics beside its checkpoints and adapter
    (`<default_root_dir>/<name>/version_N/metrics.csv`) instead of into the folder a config named for another run.
    `python -m vlm_retrofit` resolves the folder as the trainer is built; a `Trainer` of your own either passes
    `save_dir` or calls `use_run_folder(trainer)` before fitting.
    """

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "logs",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        """
        Args:
            save_dir: Folder of the logs. None: the trainer's `default_root_dir`.
            name: Subfolder of `save_dir` holding one `version_N` folder per run.
            version: Version folder to write; None takes the next free `version_N`.
            prefix: Put before every metric key.
            flush_logs_every_n_steps: How often the metrics file is written.
        """
        self._follows_run_folder = save_dir is None
        super().__init__(save_dir if save_dir is not None else os.curdir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)

    def use_run_folder(self, trainer: Any) -> None:
        """Take `trainer.default_root_dir` as the folder, unless a `save_dir` was given."""
        if self._follows_run_folder:
            self._save_dir = self._root_dir = os.fspath(trainer.default_root_dir)
            self._fs = get_filesystem(self._root_dir)  # e.g. a remote root: its versions are listed there
            self._follows_run_folder = False

    @property
    def experiment(self) -> Any:
        if self._follows_run_folder:
            raise RuntimeError("RunCSVLogger(save_dir=None) writes under a trainer's default_root_dir: "
                               "call use_run_folder(trainer) before fitting, or give save_dir")
        return super().experiment
