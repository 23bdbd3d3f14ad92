"""Data-pipeline throughput (read + decode + processor + collate) in samples/s for several DataLoader worker counts."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def measure(processor: str, shards: str | None, data_dir: str, workers: int, batch_size: int, batches: int,
            image_size: int) -> float:
    """Samples per second over `batches` batches of the training stream, after one warm-up batch."""
    from vlm_retrofit.datamodules import WebDatasetDataModule, ensure_synthetic_shards

    if shards is None:
        ensure_synthetic_shards(data_dir, num_samples=512, image_size=image_size)
        shards = data_dir
    dm = WebDatasetDataModule(processor, train_shards=shards, val_shards=None, num_workers=workers,
                              batch_size=batch_size, train_samples_per_epoch=(batches + 1) * batch_size,
                              add_quality_callback=False)
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    next(loader)  # worker start-up and first shard open are not throughput
    n, start = 0, time.perf_counter()
    for batch in loader:
        n += batch["num_samples"]
    return n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--processor", default="tiny:qwen2_vl", help="tiny:<family>, HF id or local path")
    p.add_argument("--shards", default=None, help="shard pattern / folder (default: built-in synthetic data)")
    p.add_argument("--data-dir", default=str(Path(__file__).parent / ".cache" / "synthetic"),
                   help="where the synthetic shards are cached")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=20, help="timed batches per setting (total over workers)")
    p.add_argument("--image-size", type=int, default=224, help="side of the synthetic images")
    args = p.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    rates = {}
    for w in counts:
        rates[w] = measure(args.processor, args.shards, args.data_dir, w, args.batch_size, args.batches,
                           args.image_size)
        print(f"  workers={w}: {rates[w]:.1f} samples/s", file=sys.stderr)
    print(f"processor {args.processor}, batch {args.batch_size}, {args.batches} batches per setting")
    print(" | ".join(f"{'workers=' + str(w):>12}" for w in counts))
    print(" | ".join(f"{rates[w]:>8.1f} s/s" for w in counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
