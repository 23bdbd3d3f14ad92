"""`WebDatasetDataModule`: image-text (and text-only) WebDataset shards -> processor-formatted distillation batches."""

from __future__ import annotations

import glob
import json
import math
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from webdataset.shardlists import expand_urls
from webdataset.utils import pytorch_worker_info

from vlm_retrofit.errors import InputError

from .formatting import ChatFormatter, load_processor
from .quality import DataQualityCallback
from .samples import MAX_IMAGE_PIXELS
from .shards import MANIFEST
from .stream import (
    EpochLoader,
    EpochState,
    ShardError,
    Stages,
    batches_per_worker,
    batches_trained_this_epoch,
    ignore_ctrl_c,
    train_pipeline,
    val_pipeline,
)
from .synthetic import ensure_synthetic_shards

DEFAULT_DATA_DIR = os.path.join(tempfile.gettempdir(), "vlm_retrofit", "synthetic")
_REMOTE = ("pipe:", "http://", "https://", "s3://", "gs://", "ais://", "hf://", "htgs://", "gsutil:")


def manifest_urls(folder: str | os.PathLike, split: str) -> list[str]:
    """Shard paths of `split` ("train" / "val") listed in `folder/manifest.json` (empty if the split is absent)."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    info = manifest.get("splits", {}).get(split)
    return [str(Path(folder) / s["name"]) for s in info["shards"]] if info else []


def resolve_shards(spec: str | list[str], what: str = "shards") -> list[str]:
    """Expand brace patterns (`a-{000..009}.tar`), `::`-joined lists, globs and folders of tars into URLs, and
    check that every LOCAL shard exists and is a tar. Remote URLs (`pipe:`, http, ...) are passed through."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    urls: list[str] = []
    for s in specs:
        s = os.path.expanduser(str(s))
        if os.path.isdir(s):
            found = sorted(glob.glob(os.path.join(s, "*.tar")))
            if not found:
                raw = "; it holds files, not shards: build shards from a folder of images with same-name .txt " \
                      "captions (or a JSONL file) with `python -m vlm_retrofit shards --input <it> --output <dir>`" \
                    if os.listdir(s) else ""
                raise ShardError(f"{what}: folder {s!r} contains no .tar shards{raw}")
            urls += found
            continue
        for url in expand_urls(s):
            url = url[len("file:"):] if url.startswith("file:") else url
            if not url.startswith(_REMOTE) and any(c in url for c in "*?["):
                matched = sorted(glob.glob(url))
                if not matched:
                    raise ShardError(f"{what}: pattern {url!r} matched no files")
                urls += matched
            else:
                urls.append(url)
    if not urls:
        raise ShardError(f"{what}: {spec!r} matched no shards")
    local = [u for u in urls if not u.startswith(_REMOTE)]
    missing = [u for u in local if not os.path.isfile(u)]
    if missing and len(missing) == len(urls):
        raise ShardError(f"{what}: {spec!r} matched no files ({len(missing)} expanded names, none exists; "
                         f"first: {missing[0]!r})")
    if missing:
        raise ShardError(f"{what}: {len(missing)} of {len(urls)} shards do not exist, e.g. {missing[:3]}")
    for u in local:
        if not tarfile.is_tarfile(u):
            raise ShardError(f"{what}: {u!r} is not a tar file (WebDataset shards must be .tar archives)")
    return urls


def _is_manifest_dir(spec: str) -> bool:
    return (Path(spec).expanduser() / MANIFEST).is_file()


def _train_split_urls(spec: str | list[str]) -> list[str]:
    """The checked shards of one training entry: a shard builder's folder gives its manifest's train split."""
    if isinstance(spec, str) and _is_manifest_dir(spec):
        urls = manifest_urls(Path(spec).expanduser(), "train")
        if not urls:
            raise ShardError(f"train_shards: {spec!r} has no train split in its {MANIFEST}")
        return resolve_shards(urls, "train_shards")
    return resolve_shards(spec, "train_shards")


def _check_weights(entries: list[str], weights: list[float]) -> None:
    """`train_weights` against the entries of `train_shards` they weigh."""
    if len(weights) != len(entries):
        raise ShardError(f"train_weights: {len(weights)} weights for {len(entries)} train_shards entries: give "
                         "one weight per entry of the train_shards list (each entry is one source)")
    bad = [w for w in weights
           if isinstance(w, bool) or not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0)]
    if bad:
        raise ShardError(f"train_weights: {bad} are not finite numbers > 0 (a source to leave out is left out of "
                         "train_shards)")


class WebDatasetDataModule(pl.LightningDataModule):
    """Streams image-text WebDataset shards and formats them with the backbone's processor for distillation.

    Training: resampled shards (split by rank and worker when there are enough), shuffled, `with_epoch`
    (`train_samples_per_epoch` per rank), deterministic given `seed`; with `train_weights`, each entry of
    `train_shards` is a source drawn per sample in those proportions; a run resumed from a checkpoint continues
    the stream where it stopped (`EpochLoader`). Validation: one finite pass, shards split by rank
    (`wds.split_by_node`) then worker; setup() refuses fewer shards than ranks x workers.

    Batch format (a dict; see `formatting` for the exact loss-mask alignment):

    * every model-forward input the family's processor returns (`input_ids`, `attention_mask`, `pixel_values`,
      `image_grid_thw`, `mm_token_type_ids`, `token_type_ids`, `pixel_attention_mask`, `image_sizes`, ...),
      RIGHT-padded, at most `max_length` long;
    * `loss_mask` (bool [B, T]): True at t iff `input_ids[:, t+1]` is a response token (aligned with `logits[:, t]`);
    * `skipped` ({reason: int}): samples the producing worker skipped since its previous batch;
      `skipped_shards` ({shard url: int}) the same by shard; `num_samples` (int): rows in this batch;
      with `train_weights`, `source_samples` ({source index: int}): its rows by source.
      `vlm_retrofit.batch.model_inputs(batch)` drops these meta entries. `DataQualityCallback` sums them.
    """

    def __init__(
        self,
        processor: str,
        train_shards: str | list[str] | None = None,
        train_weights: list[float] | None = None,
        val_shards: str | list[str] | None = None,
        data_dir: str | None = None,
        image_keys: list[str] | None = None,
        text_keys: list[str] | None = None,
        prompt: str = "Describe the image.",
        max_length: int = 512,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 2,
        seed: int = 0,
        train_samples_per_epoch: int = 1024,
        shuffle_buffer: int = 256,
        group_by_modality: bool = False,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        max_image_side: int = 2048,
        max_bad_fraction: float = 0.05,
        min_samples_for_check: int = 200,
        synthetic_samples: int = 512,
        text_only_fraction: float = 0.0,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        add_quality_callback: bool = True,
    ):
        """
        Args:
            processor: `"tiny:<family>"` (offline test processor) or a HF id / local path of the backbone whose
                processor and chat template format the samples (AutoProcessor; AutoTokenizer for text LMs).
            train_shards: training shards: a path, brace pattern (`/d/train-{000000..000099}.tar`), glob, folder
                of tars, a folder with a `manifest.json` from the shard builder, `pipe:` command or http URL, or a
                list of these. `None`: built-in synthetic shapes data written once into `data_dir`.
            train_weights: one weight > 0 per entry of a `train_shards` list, making each entry a SOURCE: every
                training sample is drawn from source i with probability weights[i] / sum (e.g. `[3, 1]`: three
                quarters of the samples from the first entry), each source's shards resampled on their own, and
                batches count their samples per source (`DataQualityCallback` logs `data/source_share/<i>`).
                `None`: all entries' shards are pooled and drawn whole, uniformly, so a source's share follows its
                number of shards times their size, and arrives in streaks of a whole shard.
            val_shards: validation shards (same forms). `None`: the `val` splits of the manifest folders among
                `train_shards` (and of the synthetic data) if any, else no validation.
            data_dir: cache folder for the synthetic data (default: a folder per setting under
                `<tmp>/vlm_retrofit/synthetic`); reused when its manifest matches. Its val split has at least
                ranks x workers shards.
            image_keys: image extensions to look for, in order (default jpg, jpeg, png, webp).
            text_keys: text extensions to look for, in order (default txt, json): a caption or a conversation.
            prompt: user text paired with the image for caption samples.
            max_length: longest sequence in tokens (image tokens included); longer samples are cut on the right,
                samples whose prompt alone is longer are skipped (`too_long`).
            batch_size: training samples per batch (per rank).
            val_batch_size: validation batch size (default: batch_size).
            num_workers: DataLoader worker processes (each reads its own shards and forms its own batches).
            seed: base seed: the training stream (shard choice, shuffle) is a function of seed, rank, worker, epoch.
                Under `python -m vlm_retrofit fit` it is linked to (set by) `model.seed`.
            train_samples_per_epoch: samples per epoch and rank (`with_epoch`; the resampled stream is infinite).
            shuffle_buffer: sample shuffle buffer per worker (0 disables).
            group_by_modality: batch image samples with image samples and text-only with text-only, even when the
                processor could mix them: less padding when their lengths differ (always on for processors that
                cannot mix).
            max_image_pixels: images with more pixels are skipped (`huge_image`) without being decoded.
            max_image_side: images with a longer side are downscaled (aspect kept) before the processor.
            max_bad_fraction: stop training (at the end of the step, saved) once more than this fraction of the samples
                a `fit` drew is unusable; a resumed fit counts its own draws.
            min_samples_for_check: do not apply max_bad_fraction before a fit drew this many samples.
            synthetic_samples: number of synthetic samples when train_shards is None.
            text_only_fraction: fraction of text-only conversations mixed into the synthetic data.
            persistent_workers: keep DataLoader workers alive between epochs.
            pin_memory: pin batches in page-locked memory (for GPU training).
            add_quality_callback: add a `DataQualityCallback` to the trainer at setup() if it has none
                (logs `data/skipped/<reason>` every epoch and enforces max_bad_fraction).
        """
        super().__init__()
        counts = dict(max_length=max_length, batch_size=batch_size, val_batch_size=val_batch_size,
                      train_samples_per_epoch=train_samples_per_epoch, synthetic_samples=synthetic_samples,
                      max_image_pixels=max_image_pixels, max_image_side=max_image_side)
        bad = [f"{k} must be >= 1, got {v}" for k, v in counts.items() if v is not None and v < 1]
        bad += [f"{k} must be >= 0, got {v}" for k, v in dict(num_workers=num_workers, shuffle_buffer=shuffle_buffer,
                                                                  min_samples_for_check=min_samples_for_check).items() if v < 0]
        bad += [f"{k} must be in [0, 1], got {v}" for k, v in dict(max_bad_fraction=max_bad_fraction,
                                                                     text_only_fraction=text_only_fraction).items()
                if not 0 <= v <= 1]
        if bad:
            raise InputError(f"WebDatasetDataModule: {'; '.join(bad)}")
        self.save_hyperparameters()
        self.processor_name = processor
        self.train_shards, self.train_weights, self.val_shards = train_shards, train_weights, val_shards
        self.data_dir = data_dir
        self.image_keys = list(image_keys or ["jpg", "jpeg", "png", "webp"])
        self.text_keys = list(text_keys or ["txt", "json"])
        self.prompt, self.max_length = prompt, max_length
        self.batch_size, self.val_batch_size = batch_size, batch_size if val_batch_size is None else val_batch_size
        self.num_workers, self.seed = num_workers, seed
        self.train_samples_per_epoch, self.shuffle_buffer = train_samples_per_epoch, shuffle_buffer
        self.group_by_modality = group_by_modality
        self.max_image_pixels, self.max_image_side = max_image_pixels, max_image_side
        self.max_bad_fraction, self.min_samples_for_check = max_bad_fraction, min_samples_for_check
        self.synthetic_samples, self.text_only_fraction = synthetic_samples, text_only_fraction
        self.persistent_workers, self.pin_memory = persistent_workers, pin_memory
        self.add_quality_callback = add_quality_callback
        self.train_urls: list[str] = []
        self.train_sources: list[list[str]] = []
        """The training shards of each entry of `train_shards` (the sources `train_weights` weighs)."""
        self.val_urls: list[str] = []
        self.formatter: ChatFormatter | None = None
        # Apart: a validation pass must not move the training stream (nor a resumed run's, which skips the sanity check).
        self.train_epoch_state, self.val_epoch_state = EpochState(), EpochState()

    # ------------------------------------------------------------------ set-up
    def _synthetic(self) -> str:
        """Write (or reuse) the built-in synthetic shards; returns their folder."""
        kw = dict(num_samples=self.synthetic_samples, seed=self.seed, text_only_fraction=self.text_only_fraction,
                  min_val_shards=max(4, self.world_size() * max(1, self.num_workers)))
        folder = self.data_dir or os.path.join(DEFAULT_DATA_DIR, "_".join(f"{k}{v}" for k, v in kw.items()))
        ensure_synthetic_shards(folder, **kw)
        return folder

    def prepare_data(self) -> None:
        if self.train_shards is None:  # once per node, before setup() on every rank
            self._synthetic()

    def world_size(self) -> int:
        trainer = self.trainer
        if trainer is not None:
            return int(trainer.world_size)
        return pytorch_worker_info()[1]

    def check_shards(self) -> None:
        """Resolve and check the shard specs (no processor, no model): raises `ShardError` with a clear message."""
        train, val = self.train_shards, self.val_shards
        if train is None:
            if self.train_weights is not None:
                raise ShardError("train_weights needs a train_shards list (one weight per entry); the built-in "
                                 "synthetic data has one source: drop train_weights")
            train = self._synthetic()
        entries = [train] if isinstance(train, str) else list(train)
        if not entries:
            raise ShardError("train_shards is an empty list: give shard paths, patterns or shard builder folders, or "
                             "leave it unset (null) for the built-in synthetic data")
        if self.train_weights is not None:
            _check_weights(entries, self.train_weights)
        self.train_sources = [_train_split_urls(spec) for spec in entries]
        self.train_urls = [u for urls in self.train_sources for u in urls]
        if val is not None:
            self.val_urls = resolve_shards(val, "val_shards")
        else:  # the shard builder's folders bring their val splits
            self.val_urls = [u for spec in entries if isinstance(spec, str) and _is_manifest_dir(spec)
                             for u in manifest_urls(Path(spec).expanduser(), "val")]
        needed = self.world_size() * max(1, self.num_workers)
        if self.val_urls and len(self.val_urls) < needed:
            raise ShardError(
                f"val_shards: {len(self.val_urls)} validation shards for {self.world_size()} rank(s) x "
                f"{max(1, self.num_workers)} worker(s): each needs at least one shard, so provide >= {needed} "
                f"shards (e.g. rebuild with --min-val-shards {needed}) or lower num_workers.")

    def setup(self, stage: str | None = None) -> None:
        self.check_shards()  # before the processor (and any model) is loaded
        if self.formatter is None:
            processor = load_processor(self.processor_name) if isinstance(self.processor_name, str) \
                else self.processor_name
            source = self.processor_name if isinstance(self.processor_name, str) else "data.processor"
            self.formatter = ChatFormatter(processor, self.max_length, source=source)
        trainer = self.trainer
        if trainer is not None and self.add_quality_callback and \
                not any(isinstance(c, DataQualityCallback) for c in trainer.callbacks):
            trainer.callbacks.append(DataQualityCallback(self.max_bad_fraction, self.min_samples_for_check))

    # ------------------------------------------------------------------ loaders
    def _stages(self, batch_size: int, shuffle: bool) -> Stages:
        if self.formatter is None:
            self.setup()
        state = self.train_epoch_state if shuffle else self.val_epoch_state
        return Stages(self.formatter, batch_size, self.seed, state, image_keys=self.image_keys,
                      text_keys=self.text_keys, prompt=self.prompt, max_image_pixels=self.max_image_pixels,
                      max_image_side=self.max_image_side, shuffle_buffer=self.shuffle_buffer if shuffle else 0,
                      group_by_modality=self.group_by_modality,
                      num_sources=len(self.train_sources) if shuffle and self.train_weights is not None else 0)

    def _loader(self, dataset, **resumable: Any) -> EpochLoader:
        return EpochLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                           persistent_workers=self.persistent_workers and self.num_workers > 0,
                           worker_init_fn=ignore_ctrl_c if self.num_workers > 0 else None, **resumable)

    def _batches_trained_this_epoch(self) -> int:
        return batches_trained_this_epoch(self.trainer, self.train_batches_per_worker * max(1, self.num_workers))

    @property
    def train_batches_per_worker(self) -> int:
        return batches_per_worker(self.train_samples_per_epoch, self.batch_size, self.num_workers)

    def train_dataset(self):
        return train_pipeline(self.train_sources, self._stages(self.batch_size, True), self.train_batches_per_worker,
                              self.train_weights)

    def val_dataset(self):
        return val_pipeline(self.val_urls, self._stages(self.val_batch_size, False))

    def train_dataloader(self):
        return self._loader(self.train_dataset(), consumed=self._batches_trained_this_epoch,
                            batches_per_epoch=self.train_batches_per_worker * max(1, self.num_workers),
                            samples_per_batch=self.batch_size)

    def val_dataloader(self):
        return self._loader(self.val_dataset(), required="val_shards") if self.val_urls else []

    def test_dataloader(self):
        """`python -m vlm_retrofit test` reads the validation shards: point `val_shards` at a held-out split."""
        return self.val_dataloader()

    def predict_dataloader(self):
        """`python -m vlm_retrofit predict` (per-batch KL and compute) reads the validation shards too."""
        return self.val_dataloader()
