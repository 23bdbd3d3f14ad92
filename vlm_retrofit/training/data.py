"""FixedBatchDataModule: a small deterministic in-memory dataset (the same batches every epoch).

For tests, debugging and overfitting checks: batch k of every epoch is identical, and a resumed run continues
the epoch where its checkpoint stopped, so it sees exactly the data an uninterrupted run sees. Real training
streams WebDataset shards (`vlm_retrofit.datamodules.WebDatasetDataModule`).
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset


class _Batches(Dataset):
    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.batches[index]


class FixedBatchDataModule(pl.LightningDataModule):
    """Synthetic shapes captions (and optional text-only Q&A) formatted once with the backbone's processor."""

    def __init__(
        self,
        processor: str = "tiny:qwen2_vl",
        num_batches: int = 4,
        val_batches: int = 1,
        batch_size: int = 4,
        max_length: int = 256,
        seed: int = 0,
        image_size: int = 56,
        text_only_fraction: float = 0.0,
        prompt: str = "Describe the image.",
    ) -> None:
        """
        Args:
            processor: `tiny:<family>` or a HF id / local folder (as in WebDatasetDataModule).
            num_batches: training batches per epoch (the same ones, in the same order, every epoch).
            val_batches: validation batches (0: no validation).
            batch_size: samples per batch.
            max_length: longest sequence in tokens.
            seed: seed of the synthetic scenes.
            image_size: side of the synthetic images in pixels.
            text_only_fraction: fraction of text-only conversations.
            prompt: user text paired with each image.
        """
        super().__init__()
        self.save_hyperparameters()
        self.train_batches: list[dict[str, Any]] = []
        self.val_batches: list[dict[str, Any]] = []

    def _examples(self, count: int, rng: random.Random) -> list[Any]:
        from ..datamodules.formatting import Example
        from ..datamodules.synthetic import render_scene, text_conversation

        hp = self.hparams
        out = []
        for i in range(count):
            if rng.random() < hp.text_only_fraction:
                msgs = text_conversation(rng)
                out.append(Example(f"text_{i}", "fixed", [(m["role"], m["content"]) for m in msgs], None))
            else:
                image, caption = render_scene(rng, hp.image_size)
                out.append(Example(f"scene_{i}", "fixed", [("user", hp.prompt), ("assistant", caption)], image))
        return out

    def _format(self, formatter, examples: list[Any]) -> list[dict[str, Any]]:
        size = self.hparams.batch_size
        batches = []
        for start in range(0, len(examples), size):
            batch, rejected = formatter.collate(examples[start:start + size])
            if rejected:
                raise ValueError(f"FixedBatchDataModule: samples rejected by the processor: {rejected[:3]}")
            if batch is not None:
                batches.append(batch)
        return batches

    def setup(self, stage: str | None = None) -> None:
        if self.train_batches:
            return
        from ..datamodules.formatting import ChatFormatter, load_processor

        hp = self.hparams
        formatter = ChatFormatter(load_processor(hp.processor), hp.max_length)
        rng = random.Random(hp.seed)
        self.train_batches = self._format(formatter, self._examples(hp.num_batches * hp.batch_size, rng))
        self.val_batches = self._format(formatter, self._examples(hp.val_batches * hp.batch_size, rng))

    def _loader(self, batches: list[dict[str, Any]]) -> DataLoader:
        return DataLoader(_Batches(batches), batch_size=None, shuffle=False, num_workers=0)

    def train_dataloader(self) -> DataLoader:
        from ..datamodules.stream import EpochLoader

        # Resumable: Lightning saves the batches this epoch trained on with a checkpoint, and the resumed pass
        # drops them (a plain loader would start the epoch again at batch 0).
        return EpochLoader(_Batches(self.train_batches), batch_size=None, shuffle=False, num_workers=0,
                           consumed=self._batches_trained_this_epoch, batches_per_epoch=len(self.train_batches),
                           samples_per_batch=self.hparams.batch_size)

    def _batches_trained_this_epoch(self) -> int:
        from ..datamodules.stream import batches_trained_this_epoch

        return batches_trained_this_epoch(self.trainer, len(self.train_batches))

    def val_dataloader(self) -> DataLoader | list:
        return self._loader(self.val_batches) if self.val_batches else []

    def test_dataloader(self) -> DataLoader | list:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader | list:
        return self.val_dataloader()
