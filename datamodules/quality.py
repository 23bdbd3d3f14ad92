"""Counting skipped samples: per-worker counters, run totals, the bad-fraction check and a Lightning callback."""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from typing import Any, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from vlm_retrofit.errors import InputError

log = logging.getLogger("vlm_retrofit.datamodules")

#: Every reason a sample can be skipped for (all are logged every epoch, zeros included).
REASONS: tuple[str, ...] = (
    "corrupt_image",  # image bytes that PIL cannot decode (truncated / garbage)
    "huge_image",  # more pixels than `max_image_pixels` (refused before decoding)
    "missing_image",  # a caption, or a conversation that mentions an image, without an image file
    "missing_text",  # no caption / conversation file in the sample
    "empty_text",  # caption or every assistant turn is empty
    "bad_json",  # json text that does not parse or has no recognisable caption / conversation
    "truncated_tar",  # a shard damaged after its start (ends early); the rest of that shard is lost
    "unreadable_shard",  # a shard that cannot be opened or read at all (missing, not a tar, failing pipe / http)
    "too_long",  # the prompt (with its image tokens) alone exceeds `max_length`
    "format_error",  # the processor rejected the sample
)

# The data counts are summed over ranks by hand (`DataQualityCallback._reduced`) and logged by rank 0 alone:
# Lightning's advice to sync them (one warning per metric under DDP, 30 of them) does not apply.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('(val/|test/)?data/",
                        category=PossibleUserWarning)


class DataQualityError(InputError, RuntimeError):
    """Too large a fraction of the samples was unusable: reported as input (`fit stopped: ...`, one line)."""

    verb = "stopped"  # the run got under way (and a training stop is saved) before the data showed itself bad


class SkipCounter:
    """Skips seen by ONE producer (a DataLoader worker, or the main process with `num_workers=0`).

    `skip()` logs a warning line naming shard, key and reason (the first `logged_per_reason` of each reason, then
    every `log_every`-th: a stream of bad samples would otherwise write gigabytes of log); `take()` returns the
    counts since the previous `take()` and resets them, so every batch carries only its own news and the main
    process can simply sum. A producer that skips `no_batch_limit` samples before forming its first batch raises
    `DataQualityError`: the training stream resamples its shards forever, so with no usable sample it would never
    yield a batch, and the bad-fraction check, which runs on batches, would never fire.
    """

    logged_per_reason = 20
    log_every = 1000
    no_batch_limit = 1000

    def __init__(self) -> None:
        self.reasons: Counter[str] = Counter()
        self.shards: Counter[str] = Counter()
        self._seen: Counter[str] = Counter()
        """Skips by reason over this producer's life (for the log's rate limit)."""
        self._shards_seen: Counter[str] = Counter()
        self.batches_formed = 0

    def skip(self, reason: str, shard: str, key: str | None, detail: Any = "") -> None:
        assert reason in REASONS, reason
        self.reasons[reason] += 1
        self.shards[str(shard)] += 1
        self._seen[reason] += 1
        self._shards_seen[str(shard)] += 1
        seen = self._seen[reason]
        if seen <= self.logged_per_reason or seen % self.log_every == 0:
            detail = str(detail).splitlines()[0][:200] if str(detail) else ""
            log.warning("skipped sample %r in shard %s: %s%s%s", key, shard, reason, f" ({detail})" if detail else "",
                        f" [{seen} {reason} skips so far; further ones are counted, every {self.log_every}th logged]"
                        if seen >= self.logged_per_reason else "")
        if not self.batches_formed and (total := sum(self._seen.values())) >= self.no_batch_limit:
            worst = ", ".join(f"{s} ({n})" for s, n in self._shards_seen.most_common(3))
            raise DataQualityError(f"the first {total} samples read were all unusable ({dict(self._seen)}), so no "
                                   f"batch can be formed; shards: {worst}. Check the shards' image and text keys "
                                   "(image_keys / text_keys) and that the files decode")

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        """The skips since the previous call, as (by reason, by shard); called as a batch is formed."""
        self.batches_formed += 1
        reasons, shards = dict(self.reasons), dict(self.shards)
        self.reasons.clear()
        self.shards.clear()
        return reasons, shards


def check_bad_fraction(
    skipped: Mapping[str, int],
    num_good: int,
    max_bad_fraction: float = 0.05,
    min_samples: int = 100,
    shard_counts: Mapping[str, int] | None = None,
    top: int = 5,
) -> float:
    """Return bad / (bad + good); raise `DataQualityError` if it exceeds `max_bad_fraction`.

    Nothing is raised before `min_samples` samples (good + bad) were seen, so a few early bad samples cannot stop
    a run. The message names the `top` shards with the most skipped samples (from `shard_counts`).
    """
    bad = int(sum(skipped.values()))
    total = bad + int(num_good)
    frac = bad / total if total else 0.0
    if total >= min_samples and frac > max_bad_fraction:
        worst = sorted((shard_counts or {}).items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        by_reason = ", ".join(f"{r}={n}" for r, n in sorted(skipped.items()) if n)
        shards = "; ".join(f"{s} ({n} skipped)" for s, n in worst) or "unknown"
        raise DataQualityError(
            f"{bad} of {total} training samples ({frac:.1%}) were unusable, more than max_bad_fraction="
            f"{max_bad_fraction:.1%} [{by_reason}]. Worst shards: {shards}. Fix or drop these shards, or raise "
            "max_bad_fraction."
        )
    return frac


class DataQualityTracker:
    """Running totals over the batches one process consumed (fed from `batch["skipped"]` etc.)."""

    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()
        self.shards: Counter[str] = Counter()
        self.sources: Counter[int] = Counter()
        self.num_good = 0

    def update(self, batch: Mapping[str, Any]) -> None:
        self.skipped.update({k: int(v) for k, v in (batch.get("skipped") or {}).items()})
        self.shards.update({k: int(v) for k, v in (batch.get("skipped_shards") or {}).items()})
        self.sources.update({int(k): int(v) for k, v in (batch.get("source_samples") or {}).items()})
        n = batch.get("num_samples")
        if n is None and "input_ids" in batch:
            n = len(batch["input_ids"])
        self.num_good += int(n or 0)

    def totals(self) -> dict[str, int]:
        """Counts for every reason in `REASONS` (zeros included) plus any unexpected extra reason."""
        return {r: int(self.skipped.get(r, 0)) for r in (*REASONS, *sorted(set(self.skipped) - set(REASONS)))}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": dict(self.skipped), "shards": dict(self.shards), "sources": dict(self.sources),
                "num_good": self.num_good}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped = Counter(state.get("skipped", {}))
        self.shards = Counter(state.get("shards", {}))
        self.sources = Counter({int(k): int(v) for k, v in state.get("sources", {}).items()})
        self.num_good = int(state.get("num_good", 0))


class DataQualityCallback(pl.Callback):
    """Sums the skip counts that training batches carry, logs them every epoch and stops on too much bad data.

    Logged at every train epoch end (running totals since the start of the run, summed over ranks):
    `data/skipped/<reason>` for every reason in `REASONS`, `data/samples` (usable samples),
    `data/bad_fraction` and, for weighted sources (`train_weights`), `data/source_share/<i>`: the fraction of
    rank 0's samples that came from source i. Each validation and test pass logs its own
    `val/data/skipped/<reason>` and `val/data/samples` (`test/...`), and a pass that left samples out (predict too)
    warns with the counts. When the bad fraction of the samples this fit drew exceeds `max_bad_fraction` after at
    least `min_samples` of them (checked at every epoch end and every `check_every_n_batches` batches, so a broken
    data set stops a run early), training stops at the end of that step, the checkpoint callback saves it, and
    `fit` raises `DataQualityError` naming the worst shards and the checkpoint. It removes `skipped_shards` from the
    batch (not a model input).
    """

    def __init__(self, max_bad_fraction: float = 0.05, min_samples: int = 100, check_every_n_batches: int = 50):
        super().__init__()
        self.max_bad_fraction = max_bad_fraction
        self.min_samples = min_samples
        self.check_every_n_batches = check_every_n_batches
        self.tracker = DataQualityTracker()
        self.eval_tracker = DataQualityTracker()
        """The current validation / test / predict pass's counts (not saved: each pass counts its own)."""
        self._restored_run_totals = False
        self._fit_start: tuple[dict[str, int], int] = ({}, 0)
        """This rank's counts when this fit started: the stop rule reads the counts since (summed over ranks)."""
        self.stop_error: DataQualityError | None = None
        """The reason this fit is stopping on bad data, raised once the stop is saved (`on_fit_end`)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if isinstance(batch, dict):
            self.tracker.update(batch)
            batch.pop("skipped_shards", None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # After the step, where the checkpoint callback saves: a stop here is saved at this step (`on_fit_end`).
        if self.check_every_n_batches and (batch_idx + 1) % self.check_every_n_batches == 0:
            self._check(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        totals, good, _ = self._reduced(trainer, pl_module)
        bad = sum(totals.values())
        metrics = {f"data/skipped/{r}": float(n) for r, n in totals.items()}
        metrics["data/samples"] = float(good)
        metrics["data/bad_fraction"] = bad / (bad + good) if bad + good else 0.0
        drawn = sum(self.tracker.sources.values())
        metrics.update({f"data/source_share/{i}": n / drawn for i, n in sorted(self.tracker.sources.items())})
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=False, rank_zero_only=True)
        self._check(trainer, pl_module)

    # -- evaluation: validation, test and predict batches carry their skips too -----------------------------
    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.eval_tracker = DataQualityTracker()

    on_test_epoch_start = on_predict_epoch_start = on_validation_epoch_start

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if isinstance(batch, dict):
            self.eval_tracker.update(batch)
            batch.pop("skipped_shards", None)

    on_test_batch_start = on_predict_batch_start = on_validation_batch_start

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._report_evaluation(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._report_evaluation(trainer, pl_module, "test")

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        self._report_evaluation(trainer, pl_module, "predict", log=False)  # predict logs no metrics

    def _report_evaluation(self, trainer, pl_module, stage: str, log: bool = True) -> None:
        """Log `<stage>/data/skipped/<reason>` and `<stage>/data/samples` for this pass (summed over ranks), and warn
        where samples were left out: the pass's metrics then cover the others only."""
        totals, good, shards = self._reduced(trainer, pl_module, self.eval_tracker)
        if log:
            metrics = {f"{stage}/data/skipped/{r}": float(n) for r, n in totals.items()}
            metrics[f"{stage}/data/samples"] = float(good)
            pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=False, rank_zero_only=True)
        bad = sum(totals.values())
        if bad:
            from lightning.pytorch.utilities import rank_zero_warn

            by_reason = ", ".join(f"{r}={n}" for r, n in sorted(totals.items()) if n)
            worst = "; ".join(f"{s} ({n})" for s, n in sorted(shards.items(), key=lambda kv: (-kv[1], kv[0]))[:3])
            rank_zero_warn(f"{stage}: {bad} of {bad + good} samples were unusable and left out of this pass's "
                           f"metrics [{by_reason}]; worst shards (this rank): {worst or 'unknown'}")

    def _reduced(self, trainer, pl_module, tracker: DataQualityTracker | None = None,
                 since: tuple[dict[str, int], int] | None = None) -> tuple[dict[str, int], int, dict[str, int]]:
        """Skip counts by reason, usable samples and skips by shard (this rank's) of `tracker`, the counts summed
        over ranks; counted from `since` (this rank's counts at some point) where given."""
        tracker = tracker or self.tracker
        totals, good = tracker.totals(), tracker.num_good
        if since is not None:
            totals = {reason: n - since[0].get(reason, 0) for reason, n in totals.items()}
            good -= since[1]
        names = list(totals)
        values = torch.tensor([*totals.values(), good], dtype=torch.float64)
        if trainer.world_size > 1:  # same decision on every rank: no rank stops alone
            values = trainer.strategy.reduce(values.to(pl_module.device), reduce_op="sum").cpu()
        vals = [int(v) for v in values.tolist()]
        return dict(zip(names, vals[:-1])), vals[-1], dict(tracker.shards)

    def _check(self, trainer, pl_module) -> None:
        """Stop training at the end of this step where the samples this fit drew (summed over ranks: every rank
        decides alike) hold too many unusable ones. The run is saved as it stops and `on_fit_end` raises the
        `DataQualityError`: nothing trained is lost, and a run resumed on repaired shards is judged on what it
        draws from them, not on the bad samples it counted before (the logged totals still cover the whole run)."""
        if self.stop_error is not None:
            return
        totals, good, shards = self._reduced(trainer, pl_module, since=self._fit_start)
        try:
            check_bad_fraction(totals, good, self.max_bad_fraction, self.min_samples, shards)
        except DataQualityError as error:
            from vlm_retrofit.training.checkpoint import stop_after_this_step

            self.stop_error = error
            stop_after_this_step(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        error, self.stop_error = self.stop_error, None
        if error is None:
            return
        saved = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
        where = (f"; saved there as {saved}: `--ckpt_path last` resumes from it once the shards are repaired"
                 if saved and os.path.isfile(saved) else
                 ", unsaved: the trainer's checkpoint callback keeps no last checkpoint (save_last)")
        raise DataQualityError(f"{error} Training stopped at step {trainer.global_step}{where}.")

    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker.state_dict()}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # Only rank 0's checkpoint is written, and every rank of a resumed run restores it. Under DDP it holds the
        # run's totals summed over ranks, which rank 0 alone takes back (`on_fit_start`): restored on every rank
        # as they were, rank 0's counts came back once per rank and the other ranks' were lost.
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is None:
            return
        if trainer.world_size > 1:
            totals, good, _ = self._reduced(trainer, pl_module)  # every rank saves: the reduction is collective
            state["tracker"] = {**state["tracker"], "skipped": totals, "num_good": good}
        # The run's totals, also from one process: resumed on several, the other ranks then count anew (they
        # counted rank 0's totals again before, when a single process's checkpoint was resumed under DDP).
        state["summed_over_ranks"] = True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict.get("tracker", {}))
        self._restored_run_totals = bool(state_dict.get("summed_over_ranks"))

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._restored_run_totals and trainer.global_rank != 0:
            self.tracker = DataQualityTracker()  # rank 0 carries the run's totals; this rank counts its own anew
        self._restored_run_totals = False
        self._fit_start = (self.tracker.totals(), self.tracker.num_good)
        self.stop_error = None

