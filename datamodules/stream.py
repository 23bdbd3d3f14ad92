"""WebDataset pipelines: resampled + shuffled training stream, finite split validation pass, skip counting."""

# Stages run inside each DataLoader worker (batches are formed there; the DataLoader uses `batch_size=None`).
# Every stage shares the worker's `SkipCounter`; each batch carries the skips since the previous batch.

from __future__ import annotations

import hashlib
import itertools
import math
import random
import re
import signal
import tarfile
from collections import Counter, deque
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import webdataset as wds
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset
from webdataset.filters import _shuffle
from webdataset.utils import pytorch_worker_info

from vlm_retrofit.errors import InputError

from .formatting import ChatFormatter, Example
from .quality import DataQualityError, SkipCounter
from .samples import Skip, decode_sample

class ShardError(InputError):
    """Shard patterns that cannot be used (nothing matched, missing files, not tars, too few for the workers, a
    training source none of whose shards yields a sample)."""


def stream_seed(*parts: int | str) -> int:
    """A 31-bit seed hashed from `parts`. webdataset's `make_seed` is linear (seed x 31 + next part), so nesting it
    aliases: seed s + 1 at epoch e would draw what seed s draws at epoch e + 1."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's rule: key up to the first dot of the basename


class EpochState:
    """Epoch number set in the main process; forked / pickled into workers with the dataset at each epoch."""

    def __init__(self) -> None:
        self.epoch = 0
        self.stream_epoch = 0
        """The epoch the pass now read belongs to, in this copy (`EpochPipeline`): what the stream is seeded by."""


class EpochPipeline(wds.DataPipeline):
    """A pipeline whose every pass sets `epoch_state.stream_epoch` before any stage runs.

    A copy in a fresh worker sees the main process's epoch; one kept across epochs (persistent workers, or the
    main process with no workers) counts its own passes from the epoch of its first. Either way the stream of
    epoch e is a function of e alone, so a resumed run (`EpochLoader.load_state_dict`) reads what an uninterrupted
    one would."""

    epoch_state: EpochState

    def __iter__(self):
        if getattr(self, "_first_epoch", None) is None:
            self._first_epoch, self._passes = self.epoch_state.epoch, 0
        self._passes += 1
        self.epoch_state.stream_epoch = self._first_epoch + self._passes - 1
        return super().__iter__()


class WorkerSeed:
    """`worker_seed` for `wds.ResampledShards`: `stream_seed` of `salt` (what the stream is: the pooled shards, or
    a weighted source and its index, with the base seed), rank, worker and stream epoch."""

    def __init__(self, state: EpochState, *salt: int | str) -> None:
        self.state, self.salt = state, salt

    def __call__(self) -> int:
        rank, _, worker, _ = pytorch_worker_info()
        return stream_seed(*self.salt, rank, worker, self.state.stream_epoch)


class ShardWatch:
    """Stops a resampled shard stream that never yields a sample (all of its shards unreadable or empty) with a
    `ShardError` naming it, instead of spinning forever: `opening` counts the shards opened since the last sample
    `yielding` passed on, and raises past `10 x shards + 10` of them (a run of bad draws that long among usable
    shards has odds below 2^-10)."""

    def __init__(self, what: str, urls: list[str], remedy: str = "fix those shards or leave them out") -> None:
        self.what, self.urls, self.remedy, self.opened = what, urls, remedy, 0

    def opening(self, shards: Iterable[dict]) -> Iterator[dict]:
        self.opened = 0
        for item in shards:
            self.opened += 1
            if self.opened > 10 * len(self.urls) + 10:
                raise ShardError(f"{self.what} ({self.urls[0]!r}, ... {len(self.urls)} shards): {self.opened - 1} "
                                 f"shards read in a row without one usable sample; {self.remedy}")
            yield item

    def yielding(self, samples: Iterable[dict]) -> Iterator[dict]:
        for sample in samples:
            self.opened = 0
            yield sample


class SplitResampledShards(wds.ResampledShards):
    """`wds.ResampledShards` that first splits the shard list by node and worker when there are enough shards.

    Rank r / worker w of R ranks x W workers draws (with replacement, seeded by seed, rank, worker and epoch: the
    stream epoch, not a count of this copy's passes, so that a resumed run draws the same)
    only from `urls[r * W + w :: R * W]`, so ranks and workers read disjoint shards; with fewer shards than
    R x W every producer draws from all shards (still a different random sequence each)."""

    def __iter__(self):
        rank, world, worker, workers = pytorch_worker_info()
        n, i = world * workers, rank * workers + worker
        urls = self.urls[i::n] if len(self.urls) >= n else self.urls
        self.rng = random.Random(stream_seed(self.worker_seed(), self.seed))
        for _ in range(self.nshards):
            yield dict(url=urls[self.rng.randint(0, len(urls) - 1)])


class MixedSources(IterableDataset):
    """Raw samples drawn one at a time from several sources: source i with probability `weights[i] / sum`.

    Each source is its own `SplitResampledShards` stream (split by rank and worker on its own, seeded by the base
    seed, its index, rank, worker and stream epoch) read by `stages.read`; which source the next sample comes from
    is drawn per sample, seeded alike, so the mix holds at every scale of the run instead of in whole-shard
    streaks, and a resumed run draws what an uninterrupted one would. Every sample carries its source's index as
    `__source__`. A source none of whose shards yields a sample stops the run (`ShardWatch`)."""

    def __init__(self, sources: list[list[str]], weights: list[float], stages: "Stages") -> None:
        super().__init__()
        self.sources, self.stages = sources, stages
        self.cum_weights = list(itertools.accumulate(float(w) for w in weights))

    def __iter__(self):
        state, seed = self.stages.state, self.stages.seed

        def stream(i: int, urls: list[str]) -> Iterator[dict]:
            watch = ShardWatch(f"train_shards entry {i}", urls,
                               "fix those shards or drop the entry (and its weight)")
            shards = SplitResampledShards(urls, seed=0, worker_seed=WorkerSeed(state, "source", seed, i),
                                          deterministic=True)
            return watch.yielding(self.stages.read(watch.opening(shards)))

        streams = [stream(i, urls) for i, urls in enumerate(self.sources)]
        rank, _, worker, _ = pytorch_worker_info()
        rng = random.Random(stream_seed("mix", seed, rank, worker, state.stream_epoch))
        indices = range(len(streams))
        while True:
            i = rng.choices(indices, cum_weights=self.cum_weights)[0]
            sample = next(streams[i], None)  # resampled: never ends
            if sample is None:
                return
            sample["__source__"] = i
            yield sample


def ignore_ctrl_c(worker_id: int) -> None:
    """DataLoader workers leave Ctrl-C to the main process: it stops training at the end of the step and saves it
    (`RetrofitCheckpoint`), which needs the workers that serve the step; they end with the loader."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def batches_trained_this_epoch(trainer: Any, batches_per_epoch: int) -> int:
    """The training batches of this epoch that `trainer` has run, as an `EpochLoader`'s `consumed` counts them: at a
    checkpoint (saved on a training batch's end) that batch included, and `batches_per_epoch` once the epoch is done
    by Lightning's count (which `limit_train_batches` and the number of processes set), so that a run resumed there
    starts the next epoch rather than dropping its first batches."""
    if trainer is None:
        return 0
    processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return batches_per_epoch if processed >= trainer.num_training_batches else processed


class EpochLoader(DataLoader):
    """DataLoader that bumps the dataset's `EpochState` on every new pass (new shuffles per epoch, reproducibly).

    With `consumed` (the training loader: how many of this pass's batches the training loop has run) it is
    resumable: Lightning saves `state_dict()` in its checkpoints and restores it before the first pass, which then
    drops the batches the checkpoint had trained on and continues the stream an uninterrupted run would read. A
    resumed run does not replay its epoch from the top."""

    def __init__(self, *args: Any, consumed: Callable[[], int] | None = None, batches_per_epoch: int | None = None,
                 samples_per_batch: int | None = None, required: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed, self.batches_per_epoch = consumed, batches_per_epoch
        self.samples_per_batch = samples_per_batch
        """The pipeline's batch size (it batches itself: the loader's own `batch_size` is None)."""
        self.required = required
        """What a pass must yield a batch of (e.g. "val_shards"); a pass that yields none raises `DataQualityError`."""
        self._resume_skip = 0

    def __iter__(self):
        state = getattr(self.dataset, "epoch_state", None)
        if state is not None:
            state.epoch += 1
        iterator = super().__iter__()
        skip, self._resume_skip = self._resume_skip, 0
        for _ in range(skip):  # read and dropped: what follows depends on them (shuffle buffer, shard order)
            if next(iterator, None) is None:
                break
        return iterator if self.required is None else self._checked(iterator)

    def _checked(self, iterator: Iterator[Any]) -> Iterator[Any]:
        # Skips travel inside batches, so a pass whose every sample was unusable reports nothing and would end as
        # an empty validation: KL and keep ratios simply missing, the command exiting 0.
        yielded = 0
        for batch in iterator:
            yielded += 1
            yield batch
        if not yielded:
            rank, world, _, _ = pytorch_worker_info()
            whose = f"rank {rank}'s share of {self.required}" if world > 1 else self.required
            raise DataQualityError(f"{whose} yielded no batch: every sample was unusable (the warnings above name "
                                   "shard, key and reason) or the shards hold none. Fix or replace those shards")

    def state_dict(self) -> dict[str, int]:
        state = getattr(self.dataset, "epoch_state", None)
        return {"epoch": state.epoch if state is not None else 0,
                "batches": int(self.consumed()) if self.consumed is not None else 0,
                **self._layout()}

    def _layout(self) -> dict[str, int]:
        """What the stream's position is counted in: each rank's workers split the shards, in batches of this size."""
        world = torch.distributed.get_world_size() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 1
        return {"batch_size": int(self.samples_per_batch or 0), "num_workers": int(self.num_workers),
                "world_size": int(world)}

    def load_state_dict(self, saved: Mapping[str, int]) -> None:
        epoch, batches = int(saved.get("epoch", 0)), int(saved.get("batches", 0))
        layout = self._layout()
        changed = {k: (saved[k], v) for k, v in layout.items() if k in saved and saved[k] != v}
        if changed:
            # The position is a count of batches of each worker's stream: other batches or workers read another
            # stream, so the resumed epoch is not the one an uninterrupted run would have read.
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            rank_zero_warn(f"resuming the training stream with {what}: its position ({batches} batches into epoch "
                           f"{max(0, epoch - 1)}, counting from 0) was counted in the checkpoint's batches, so this "
                           "epoch continues on another stream and its sample count differs from an uninterrupted "
                           "run's. Keep batch_size, num_workers and the number of processes to continue exactly")
        if self.batches_per_epoch and batches >= self.batches_per_epoch:
            batches = 0  # saved on the epoch's last batch: the next pass is the next epoch's
        else:
            epoch -= 1  # the next pass is the saved one again (`__iter__` counts it)
        state = getattr(self.dataset, "epoch_state", None)
        if state is not None:
            state.epoch = epoch
        self._resume_skip = batches


class _TailReader:
    """A binary stream that remembers how many bytes were read from it and at least the last `keep` of them (as
    the chunks read: nothing is copied per read)."""

    keep = 4 * tarfile.RECORDSIZE  # tarfile reads a stream a record at a time: the end lies within the last two

    def __init__(self, stream: Any) -> None:
        self.stream, self.read_bytes = stream, 0
        self._chunks: deque[bytes] = deque()
        self._held = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.read_bytes += len(data)
        self._chunks.append(data)
        self._held += len(data)
        while self._held - len(self._chunks[0]) >= self.keep:
            self._held -= len(self._chunks.popleft())
        return data

    def zero_blocks_after(self, offset: int) -> bool:
        """Whether the two zero blocks that end a tar follow byte `offset` (the rest of the stream is read)."""
        while self.read_bytes - offset < 2 * tarfile.BLOCKSIZE and self.read(1 << 16):
            pass
        tail = b"".join(self._chunks)
        start = len(tail) - (self.read_bytes - offset)
        end_blocks = tail[start:start + 2 * tarfile.BLOCKSIZE] if start >= 0 else b""
        return len(end_blocks) == 2 * tarfile.BLOCKSIZE and not end_blocks.strip(b"\0")


def read_shards(src: Iterable[dict], counter: SkipCounter) -> Iterator[dict[str, Any]]:
    """`{"url": ...}` -> samples `{"__key__", "__url__", ext: bytes}`; unreadable / truncated shards are counted.

    A truncated shard yields its complete samples; the sample cut by the damage (or read last before a cut between
    files, which may have lost one) and the rest of the shard are counted once as `truncated_tar`. A shard that
    fails before its first member (cannot be opened, not a tar, failing `pipe:` command) counts once as
    `unreadable_shard`."""
    for item in src:
        url = item["url"]
        try:
            stream = wds.gopen(url, "rb")
        except Exception as exn:  # noqa: BLE001
            counter.skip("unreadable_shard", url, None, f"{type(exn).__name__}: {exn}")
            continue
        current: dict[str, Any] | None = None
        members = 0
        raw = _TailReader(stream)
        try:
            with tarfile.open(fileobj=raw, mode="r|*") as tar:
                for member in tar:
                    if not member.isreg():
                        continue
                    m = _KEY_EXT.match(member.name)
                    if m is None or member.name.split("/")[-1].startswith("__"):
                        continue
                    key, ext = m.group(1), m.group(2).lower()
                    if current is not None and current["__key__"] != key:
                        yield current  # complete: the next sample has started
                        current = None
                    if current is None:
                        current = {"__key__": key, "__url__": url}
                    current[ext] = tar.extractfile(member).read()
                    members += 1
                # tarfile ends quietly at a header cut short or garbled after the first member: a tar that ends
                # without its end-of-archive blocks was cut, and the samples after the cut are lost.
                if members and not raw.zero_blocks_after(tar.offset):
                    raise EOFError(f"no end-of-archive marker after byte {tar.offset}: the shard was cut")
            if current is not None:
                yield current
        except Exception as exn:  # noqa: BLE001 - tarfile.ReadError, EOFError, OSError, pipe status ...
            key = current["__key__"] if current else None
            reason = "truncated_tar" if members or current else "unreadable_shard"  # nothing read: not a tar
            counter.skip(reason, url, key, f"{type(exn).__name__}: {exn}")
        finally:
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - a failing pipe reports here; already counted or harmless
                pass


class Stages:
    """All per-worker stages of one pipeline, sharing one `SkipCounter` (picklable for worker start-up)."""

    def __init__(self, formatter: ChatFormatter, batch_size: int, seed: int, state: EpochState, *,
                 image_keys: list[str], text_keys: list[str], prompt: str, max_image_pixels: int,
                 max_image_side: int, shuffle_buffer: int = 0, group_by_modality: bool = False, num_sources: int = 0):
        self.formatter, self.batch_size, self.seed, self.state = formatter, batch_size, seed, state
        self.group_by_modality = group_by_modality
        self.decode_kw = dict(image_keys=image_keys, text_keys=text_keys, prompt=prompt,
                              max_image_pixels=max_image_pixels, max_image_side=max_image_side)
        self.shuffle_buffer = shuffle_buffer
        self.num_sources = num_sources
        """Weighted training sources (`MixedSources`): batches then count their samples per source."""
        self.counter = SkipCounter()

    def read(self, src):
        return read_shards(src, self.counter)

    def shuffle(self, src):
        if self.shuffle_buffer <= 1:
            return src
        rank, _, worker, _ = pytorch_worker_info()
        seed = stream_seed("shuffle", self.seed, rank, worker, self.state.stream_epoch)
        return _shuffle(src, bufsize=self.shuffle_buffer, initial=max(1, self.shuffle_buffer // 2), seed=seed)

    def decode(self, src):
        for sample in src:
            try:
                ex = decode_sample(sample, **self.decode_kw)
            except Skip as s:
                self.counter.skip(s.reason, sample.get("__url__", "?"), sample.get("__key__"), s.detail)
                continue
            if "__source__" in sample:
                ex.extra["source"] = sample["__source__"]
            yield ex

    def batch(self, src: Iterable[Example]):
        """Batches of a finite pass, with one batch of look-ahead: skips found after the last batch (the end of
        the last shard) are added to that batch, so every skip of the pass reaches the main process."""
        pending = None
        for out in self.collated(src):
            if pending is not None:
                yield pending
            pending = out
        if pending is not None:
            reasons, shards = self.counter.take()
            for mine, late in ((pending["skipped"], reasons), (pending["skipped_shards"], shards)):
                for k, n in late.items():
                    mine[k] = mine.get(k, 0) + n
            yield pending

    def collated(self, src: Iterable[Example]):
        """Collate `batch_size` examples at a time, each batch yielded as soon as it is formed (one modality per
        batch if the processor cannot mix, or if `group_by_modality`: image and text-only samples differ in
        length, so mixed batches are mostly padding); partial batches at the end of a finite pass.

        The training stream batches with this directly: it never ends, and `with_epoch` closes it right after
        its last batch, so a batch held back for look-ahead would be formed, its skips taken, and dropped."""
        groups: dict[bool, list[Example]] = {}
        mix = self.formatter.can_mix and not self.group_by_modality
        for ex in src:
            group = groups.setdefault(True if mix else ex.image is not None, [])
            group.append(ex)
            if len(group) >= self.batch_size:
                out = self._collate(group)
                group.clear()
                if out is not None:
                    yield out
        for group in groups.values():
            out = self._collate(group) if group else None
            if out is not None:
                yield out

    def _collate(self, examples: list[Example]) -> dict[str, Any] | None:
        batch, rejected = self.formatter.collate(list(examples))
        for ex, reason, detail in rejected:
            self.counter.skip(reason, ex.url, ex.key, detail)
        if batch is None:
            return None
        batch["skipped"], batch["skipped_shards"] = self.counter.take()
        batch["num_samples"] = int(batch["input_ids"].shape[0])
        if self.num_sources:  # by source, not identity: a text-only processor collates copies of the examples
            kept = Counter(ex.extra["source"] for ex in examples) - Counter(ex.extra["source"] for ex, _, _ in rejected)
            batch["source_samples"] = {i: kept[i] for i in range(self.num_sources)}
        return batch


def train_pipeline(sources: list[list[str]], stages: Stages, batches_per_worker: int,
                   weights: list[float] | None = None) -> wds.DataPipeline:
    """Infinite resampled shards (split by node and worker, seeded per rank / worker / epoch) -> shuffle -> decode
    -> batch; each worker yields `batches_per_worker` batches per epoch (`with_epoch`): equal on every rank.

    `sources`: the shards of each entry of `train_shards`. Without `weights` they are pooled and read shard by
    shard; with them `MixedSources` draws every sample from source i with probability weights[i] / sum."""
    if weights is None:
        urls = [u for urls in sources for u in urls]
        shards = SplitResampledShards(urls, seed=stages.seed, worker_seed=WorkerSeed(stages.state, "shards"),
                                      deterministic=True)
        watch = ShardWatch("train_shards", urls)
        pipe = EpochPipeline(shards, watch.opening, stages.read, watch.yielding, stages.shuffle, stages.decode,
                             stages.collated)
    else:
        pipe = EpochPipeline(MixedSources(sources, weights, stages), stages.shuffle, stages.decode, stages.collated)
    pipe = pipe.with_epoch(batches_per_worker)
    pipe.epoch_state = stages.state
    return pipe


def val_pipeline(urls: list[str], stages: Stages) -> wds.DataPipeline:
    """Each shard exactly once: split by node (rank) then by worker; no shuffling; partial last batch kept."""
    pipe = wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_node, wds.split_by_worker,
                            stages.read, stages.decode, stages.batch)
    pipe.epoch_state = stages.state
    return pipe


def batches_per_worker(samples_per_epoch: int, batch_size: int, num_workers: int) -> int:
    return max(1, math.ceil(samples_per_epoch / batch_size / max(1, num_workers)))
