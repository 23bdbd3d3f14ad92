"""A few bf16-mixed distillation steps on CUDA with a tiny backbone; prints the step time.

    bench/gpu_check.sh                      # the defaults: tiny Qwen2-VL (widened), 30 steps, batch 8
    bench/gpu_check.sh --family llava --steps 50 --hidden 512 --layers 8
    bench/gpu_check.sh --allow-cpu          # smoke-test the script itself without a GPU

Nothing is downloaded. Exit status: 0 ok, 1 non-finite loss or no routers trained, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_vl", help="tiny backbone family (vlm_retrofit.testing.FAMILIES)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (the first --warmup are not timed)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256, help="decoder hidden size of the tiny backbone")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the tiny backbone")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when no CUDA device is present")
    args = parser.parse_args(argv)

    import lightning.pytorch as pl
    import torch

    from vlm_retrofit.training import FixedBatchDataModule, RetrofitModule

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); nothing to check. "
              "CPU is the tested default: `make test`.", file=sys.stderr)
        return 2
    accelerator = "cuda" if cuda else "cpu"
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {pl.__version__}, "
          f"device {device}, precision {args.precision}")

    heads = max(2, args.hidden // 64)
    module = RetrofitModule(
        backbone=f"tiny:{args.family}",
        backbone_kwargs={"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
                         "num_hidden_layers": args.layers, "num_attention_heads": heads,
                         "num_key_value_heads": max(1, heads // 2)},
        router={"skip_gate": True}, compute_target=0.75, max_drop_rate=0.1, drop_warmup_steps=0, lr=1e-2,
        warmup_steps=2, log_per_block=False,
    )
    data = FixedBatchDataModule(processor=f"tiny:{args.family}", num_batches=4, val_batches=0,
                                batch_size=args.batch_size)
    before = {k: v.detach().clone() for k, v in module.trainable_state_dict().items()}
    times: list[float] = []
    losses: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            losses.append(float("nan") if loss is None else float(loss))

    trainer = pl.Trainer(accelerator=accelerator, devices=1, precision=args.precision, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[Timer()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, data)

    timed = times[args.warmup:] or times
    tokens = int(data.train_batches[0]["attention_mask"].sum())
    after = module.trainable_state_dict()
    moved = max(float((after[k].detach().cpu() - v.cpu()).abs().max()) for k, v in before.items())
    print(f"gpu_check: {len(times)} steps of batch {args.batch_size} (~{tokens} tokens) on tiny:{args.family} "
          f"(hidden {args.hidden}, {args.layers} layers)")
    print(f"gpu_check: step time median {1000 * statistics.median(timed):.1f} ms, mean "
          f"{1000 * statistics.fmean(timed):.1f} ms, min {1000 * min(timed):.1f} ms (first {args.warmup} not timed; "
          f"first step {1000 * times[0]:.0f} ms)")
    if cuda:
        print(f"gpu_check: peak CUDA memory {torch.cuda.max_memory_allocated() / 2 ** 20:.0f} MiB")
    print(f"gpu_check: loss first {losses[0]:.4g} last {losses[-1]:.4g}; max router change {moved:.3g}")
    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)) or moved == 0:
        print("gpu_check: FAILED (non-finite loss or routers did not move)", file=sys.stderr)
        return 1
    print("gpu_check: OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
