"""`make bench`: routers on a real small VLM vs published-style baselines at matched compute, measured side by side."""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from .report import write_report
from .eval_set import build_eval_set
from .measuring import Bench
from .orders import joint_removal_order, rank_blocks, search_key, span_removal_order
from .sweep import sweep
from .training import stale_runs, train_variant, training_key, training_precision, training_shards
from .variants import DEFAULT_VARIANTS, VARIANTS, own_span_key, removal_settings, selected_variants

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache"
RUNS = CACHE / "runs"
BASELINES_OUT = CACHE / "baselines-only"
"""The default report folder of a run that trains and measures no adapter (`--variants` alone)."""


def repository_path(value: Any) -> Any:
    """An absolute path inside the repository as relative to it (a record then names no machine's folders);
    anything else as given."""
    if isinstance(value, str) and os.path.isabs(value):
        # As written first: a folder reached through a link (a checkout whose bench/.cache links to another's)
        # resolves outside the repository.
        for path in (Path(value), Path(value).resolve()):
            try:
                return path.relative_to(ROOT.parent).as_posix()
            except ValueError:  # outside the repository
                continue
    return value


def recorded_settings(args: argparse.Namespace, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """The command's settings as a results file records them (`repository_path` on each)."""
    return {k: repository_path(v) for k, v in vars(args).items() if k not in leave_out}


def load_for_measuring(args, manifest: dict[str, Any]):
    """The real VLM in `args.dtype` on `args.device` (eval mode), its processor, the eval set (`build_eval_set`
    with `args`' settings) and a function that loads another copy of the model (a LoRA is merged into one)."""
    from .real_vlm import load_real_vlm

    dtype = getattr(torch, args.dtype)

    def load_model():
        return load_real_vlm(dtype=dtype)[0].to(args.device).eval()

    model, processor = load_real_vlm(dtype=dtype)
    model = model.to(args.device).eval()
    return model, processor, build_eval_set(processor, manifest, args), load_model


def machine(args) -> str:
    """The machine a result was measured on, for its report: CPU, cores, torch, and the GPU when `args.device` is one."""
    from vlm_retrofit.hardware import cpu_description

    return (f"{cpu_description()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
            + (f", GPU {torch.cuda.get_device_name()} ({args.dtype})" if args.device.startswith("cuda") else ""))


def add_eval_arguments(parser: argparse.ArgumentParser, targets: list[float]) -> None:
    """The evaluation settings `build_eval_set` and the measurements read (shared by `python -m bench.run` and
    `python -m bench.measure`, so that their records compare): targets, test workloads, device and dtype."""
    parser.add_argument("--targets", type=float, nargs="+", default=targets,
                        help="fractions of decoder-layer executions to skip (matched across methods)")
    parser.add_argument("--speed-target", type=float, default=0.2, help="target at which decode speed is measured")
    parser.add_argument("--caption-samples", type=int, default=None,
                        help="images of the eval split for agreement / ROUGE-L (default: every one, 35 test and 43 "
                             "val; the runs before 2026-12-06 took the first 20: 320 caption tokens, over which one "
                             "row's agreement could lead another's by a few hundredths by chance)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--text-chunks", type=int, default=8, help="held-out Austen chunks for perplexity")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--calibration-batches", type=int, default=2, help="per modality, from the val splits")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every measurement, and bench.run's training)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the frozen weights (routers stay fp32)")
    parser.add_argument("--counted-on", default="response", choices=["response", "text"],
                        help="where our per-token policies' targets are counted on the caption batches: response = "
                             "the answer tokens (what a decode runs), text = every text position, the chat template "
                             "and prompt too (the runs before 2026-12-06)")


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m bench.run`."""
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--variants", nargs="*",
                        default=DEFAULT_VARIANTS, choices=sorted(VARIANTS),
                        help="adapters to train (or reuse) and measure; none (`--variants` alone): the base and the "
                             "training-free baselines only")
    parser.add_argument("--train-only", action="store_true",
                        help="train (or reuse) the variants' adapters under --runs and stop before measuring: a run "
                             "of many 20-minute budgets can be split, and a later run measures what it left")
    parser.add_argument("--train-minutes", type=float, default=20.0, help="distillation budget per variant (wall clock)")
    parser.add_argument("--decay-over", default="budget", choices=["budget", "steps"],
                        help="what the learning rate of the decaying variants (the LoRA healing) decays over: the "
                             "wall clock of --train-minutes (as many steps as it holds, on any machine) or each "
                             "variant's step count (the runs before 2026-12-03; the time budget still caps it)")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="decay over this many steps instead (implies --decay-over steps; the time budget still "
                             "caps it)")
    parser.add_argument("--train-precision", default=None, choices=["32-true", "bf16-mixed"],
                        help="Lightning precision of the distillation steps: bf16-mixed runs the matmuls in bf16 "
                             "under autocast (1.25x the steps per minute of 32-true over a whole run on 2 AVX512-BF16 "
                             "CPU cores); the KL and the trained weights stay fp32. Default: bf16-mixed where the "
                             "device has fast bf16 kernels, else 32-true (a CPU without AVX512 runs bf16 some 70x "
                             "slower than fp32: vlm_retrofit.hardware)")
    parser.add_argument("--train-dtype", default=None, choices=["float32", "bfloat16"],
                        help="dtype of the frozen weights during distillation (evaluation uses --dtype); default "
                             "bfloat16 under bf16-mixed steps (autocast then casts no frozen weight each step: "
                             "1.14-1.22x the steps per minute of float32 on 2 CPU cores, healing as much per sample), "
                             "else --dtype")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr-scale", type=float, default=1.0,
                        help="multiplies every variant's learning rate, e.g. 1.41 with --batch-size 8: at 960 samples the "
                             "square-root scaling healed about as much per sample as batch 4 (x1.137 against x1.110-1.132; "
                             "batch 16 x1.183, and twice its rate diverged): HISTORY.md, \"Healing steps\"")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="data loader workers per training run (one keeps up with a 2-core CPU's steps; a GPU's "
                             "steps need more)")
    add_eval_arguments(parser, targets=[0.1, 0.2, 0.3])
    parser.add_argument("--replacement-batches", type=int, default=16,
                        help="per modality, from the train splits: what the training-free linear replacement baseline "
                             "(static-greedy-joint-replaced) is fitted on; 0 = not measured")
    parser.add_argument("--runs", default=str(RUNS), help="trained adapters (reused when present: delete to retrain)")
    parser.add_argument("--reuse-baselines", action="store_true",
                        help="take the static / random / oracle records from <runs>/baselines.json when an earlier run "
                             "measured them with the same settings and base outputs; their decode speed is still "
                             "measured in this run")
    parser.add_argument("--reuse-measured", action="store_true",
                        help="take a trained variant's records from <runs>/<variant>/measured.json when an earlier run "
                             "measured that adapter with the same settings and base outputs (its decode speed too): a "
                             "run stopped while measuring goes on where it stopped")
    parser.add_argument("--out", default=None,
                        help="where RESULTS.md, results.json and pareto.png go (default: bench/, the recorded results; "
                             f"with `--variants` alone {BASELINES_OUT.relative_to(ROOT.parent)}, so that a baselines-only "
                             "report never replaces the recorded table)")
    return parser


def report_dir(args: argparse.Namespace) -> Path:
    """Where the run's report goes: `--out`, else bench/ for a run with variants and BASELINES_OUT without."""
    if args.out is not None:
        return Path(args.out)
    return ROOT if args.variants else BASELINES_OUT


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out = str(report_dir(args))
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the hours of work whose report goes there
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(0)
    started = time.time()
    log_path = CACHE / "bench.log"
    CACHE.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        line = f"[{time.time() - started:7.1f}s] {message}"
        print(line, flush=True)
        with open(log_path, "a") as handle:
            handle.write(line + "\n")

    from . import efficientnet_tower  # noqa: F401  registers the vision tower's config before any loading
    from .data import write_bench_shards
    from .real_vlm import build_real_vlm, weights_digest

    manifest = write_bench_shards()
    args.backbone = str(build_real_vlm())
    backbone_weights = weights_digest(args.backbone)
    log(f"assets ready: real VLM at {args.backbone} (weights {backbone_weights}); shards in {manifest['root']}")
    shards = training_shards(manifest)
    model, processor, data, load_model = load_for_measuring(args, manifest)
    runs = Path(args.runs)
    key = search_key(model, data.calibration)  # what the cached removal searches were run on
    removal_order = rank_blocks(model, data.calibration, runs, log, key=key)
    # The schedule covers every target: enough single-layer blocks to remove the largest target's share.
    num_layers = model.config.get_text_config().num_hidden_layers

    def removed_blocks(target: float) -> int:  # layers a static removal of `target` of the compute takes
        return min(len(removal_order), math.ceil(target * num_layers - 1e-9))

    max_removed_blocks, min_target_blocks = removed_blocks(max(args.targets)), removed_blocks(min(args.targets))
    speed_removed_blocks = removed_blocks(args.speed_target)
    joint_order = joint_removal_order(model, data.calibration, removal_order, max_removed_blocks, runs, log, key=key)
    span_order = span_removal_order(model, data.calibration, removal_order, speed_removed_blocks, max_removed_blocks,
                                    runs, log, key=key)
    variants = selected_variants(args.variants, args.train_steps)
    orders = {"impact": removal_order, "joint": joint_order, "span": span_order}
    target_blocks = {target: removed_blocks(target) for target in args.targets}
    for blocks in sorted({target_blocks[v.removal_target] for v in variants
                          if v.own_span and v.removal_target in target_blocks}):
        orders[own_span_key(blocks)] = span_removal_order(model, data.calibration, removal_order, blocks, blocks, runs,
                                                          log, key=key)
    removals = {v.name: removal_settings(v, orders, max_removed_blocks, speed_removed_blocks, min_target_blocks,
                                         target_blocks) for v in variants}
    decay_over = "steps" if args.train_steps else args.decay_over
    stale = stale_runs(variants, runs, {v.name: training_key(v, removals[v.name], decay_over, backbone_weights)
                                        for v in variants})
    if stale:  # refused before any work: reusing them would mislabel rows
        raise SystemExit("trained adapters that do not match this run's training (delete them to retrain):\n  "
                         + "\n  ".join(stale))
    args.train_precision, train_dtype = training_precision(args.device, args.train_precision, args.train_dtype,
                                                           args.dtype)
    training = {}
    for variant in variants:
        cached = (runs / variant.name / "train_info.json").is_file()
        log(f"reusing {variant.name} (delete its folder to retrain)" if cached
            else f"training {variant.name} for {args.train_minutes} min")
        training[variant.name] = train_variant(
            variant, args.backbone, shards, args.train_minutes, args.batch_size, removal=removals[variant.name],
            runs=runs, device=args.device,
            dtype=train_dtype, precision=args.train_precision,
            num_workers=args.num_workers, lr_scale=args.lr_scale, decay_over=decay_over)
        log(f"trained {variant.name}: {training[variant.name]}")
    if args.train_only:
        log(f"trained or reused {len(variants)} adapters under {runs}; measure them with the same command "
            "without --train-only")
        return 0

    bench = Bench(model, processor, data, args.new_tokens)
    bench.counted_on = args.counted_on
    base = bench.measure_base()
    log(f"base: {base}")
    eval_settings = ("caption_samples", "new_tokens", "text_chunks", "chunk_tokens", "calibration_batches", "device", "dtype")
    records, overhead = sweep(bench, args.targets, variants, args.speed_target, removal_order, joint_order, load_model, runs, log,
                              baseline_key={k: getattr(args, k) for k in eval_settings},
                              reuse_baselines=args.reuse_baselines, span_order=span_order,
                              reuse_measured=args.reuse_measured, machine=machine(args))
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(args),
        "backbone": "SmolLM2-135M-Instruct + EfficientNet-Lite0 features + trained LLaVA projector (bench/real_vlm.py)",
        "backbone_weights": backbone_weights,
        "base": base,
        **overhead,
        "training": training,
        "settings": recorded_settings(args, leave_out=("out", "runs")),
        "records": records,
        "seconds": round(time.time() - started, 1),
    }
    write_report(results, Path(args.out))
    log(f"wrote {Path(args.out) / 'RESULTS.md'} and results.json in {results['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
