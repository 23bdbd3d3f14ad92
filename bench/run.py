"""`make bench`: routers on a real small VLM vs published-style baselines at matched compute, measured side by side."""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .evaluate import Method, decode_speed, greedy, nullmethod, perplexity, rouge_l, teacher_forced

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache"
RUNS = CACHE / "runs"
PROMPT = "Describe the image."


@dataclass
class Variant:
    """One trained router adapter: how it is trained and which skip policy it is evaluated with."""

    name: str
    policy: str
    router: dict[str, Any]
    module: dict[str, Any] = field(default_factory=dict)
    fixed_removal: bool = False
    """Static variants: train only the speed target's prefix of the removal order (min = max removed blocks)
    instead of every prefix up to the largest target."""


# The routed recipe after the first runs: queries at 1/25 of the lr (AdamW moves all 576 query coordinates by
# ~lr per step, so routing logits swing ~lr * d) and KL on every text position (captions are ~5 answer tokens).
ROUTED = {"use_gates": False, "max_drop_rate": 0.0, "lr": 2e-3, "query_lr_scale": 0.04, "distill_positions": "text"}
LORA_QVO = {"r": 8, "lora_alpha": 16, "target_modules": r".*language_model.*\.(q_proj|v_proj|o_proj)"}
VARIANTS = {
    # Routers trained under a removal schedule (a random prefix of the removal order skipped by every token),
    # evaluated with the static policy removing a prefix of that same order: the routers re-weight around the gap.
    "routed_static": Variant("routed_static", "static", {"block_size": 1}, ROUTED),
    "routed_static_lora": Variant("routed_static_lora", "static", {"block_size": 1}, {**ROUTED, "lora": LORA_QVO}),
    # One operating point: always the speed target's blocks removed, LoRA healing that configuration only.
    "routed_static_lora_fixed": Variant("routed_static_lora_fixed", "static", {"block_size": 1},
                                        {**ROUTED, "lora": LORA_QVO}, fixed_removal=True),
    "gate": Variant("gate", "gate", {"block_size": 1, "skip_gate": True},
                    {"use_gates": True, "max_drop_rate": 0.1, "compute_target": 0.7, "compute_weight": 5.0}),
    "recent_weight": Variant("recent_weight", "recent_weight", {"block_size": 1},
                             {"use_gates": False, "max_drop_rate": 0.3, "drop_warmup_steps": 50}),
    "gate_lora": Variant("gate_lora", "gate", {"block_size": 1, "skip_gate": True},
                         {"use_gates": True, "max_drop_rate": 0.1, "compute_target": 0.7, "compute_weight": 5.0,
                          "lora": {"r": 8, "lora_alpha": 16, "target_modules": r".*language_model.*\.(q_proj|v_proj)"}}),
}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- training -----------------------------------------------------------------------------------------------
def train_variant(variant: Variant, backbone: str, shards: dict[str, Any], minutes: float, batch_size: int, *,
                  removal_order: list[int], max_removed_blocks: int, speed_removed_blocks: int, runs: Path = RUNS,
                  device: str = "cpu",
                  dtype: str | None = None) -> dict:
    """Distil one router variant within a wall-clock budget; the adapter lands in RUNS/<name>/adapter.

    Variants evaluated with the static policy train under the removal schedule over `removal_order`.
    """
    import lightning.pytorch as pl

    from vlm_retrofit.datamodules import WebDatasetDataModule
    from vlm_retrofit.training import RetrofitModule

    out = runs / variant.name
    info_path = out / "train_info.json"
    if info_path.is_file():
        return json.loads(info_path.read_text())
    module_args = {"lr": 5e-3, "warmup_steps": 20, "scheduler": "constant", **variant.module}
    if variant.policy == "static":
        removed = speed_removed_blocks if variant.fixed_removal else max_removed_blocks
        module_args.update(removal_order=removal_order, max_removed_blocks=removed,
                           min_removed_blocks=removed if variant.fixed_removal else 0)
    module = RetrofitModule(backbone=backbone, model_class="bench.efficientnet_tower.LlavaForConditionalGeneration",
                            router=variant.router, torch_dtype=dtype, **module_args)
    data = WebDatasetDataModule(processor=backbone, train_shards=shards["train"], val_shards=shards["val"],
                                batch_size=batch_size, num_workers=1, max_length=384, train_samples_per_epoch=100000,
                                add_quality_callback=True)
    timings: list[float] = []
    kl_curve: list[float] = []

    class StepTimer(pl.Callback):
        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            timings.append(time.perf_counter() - self.start)
            kl = trainer.callback_metrics.get("train/kl")
            kl_curve.append(float(kl) if kl is not None else float("nan"))

    trainer = pl.Trainer(max_time={"minutes": minutes}, max_steps=100000, limit_val_batches=0, logger=False,
                         accelerator="gpu" if device.startswith("cuda") else "cpu", devices=1,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[StepTimer()],
                         default_root_dir=out, log_every_n_steps=10)
    trainer.fit(module, data)
    module.save_adapter(out / "adapter")
    steady = timings[5:] or timings
    info = {"steps": trainer.global_step, "minutes": minutes, "batch_size": batch_size, "lr": module_args["lr"],
            "removal_order": module.adapter.removal_order, "max_removed_blocks": module.hparams.max_removed_blocks,
            "min_removed_blocks": module.hparams.min_removed_blocks,
            "query_lr_scale": module.hparams.query_lr_scale, "distill_positions": module.hparams.distill_positions,
            "device": device, "dtype": dtype or "float32",
            "step_seconds": sum(steady) / max(1, len(steady)), "peak_rss_mb": _peak_rss_mb(),
            # Mean training KL per tenth of the run (the removal prefix is random per step: read the trend).
            "kl_curve": [sum(part) / len(part) for part in (kl_curve[i * len(kl_curve) // 10:(i + 1) * len(kl_curve) // 10]
                                                           for i in range(10)) if part],
            "final_metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}}
    info_path.write_text(json.dumps(info, indent=2))
    return info


# -- evaluation ---------------------------------------------------------------------------------------------
@dataclass
class EvalSet:
    captions: list[dict[str, Any]]      # B=1 prompt inputs, one per test image
    references: list[str]
    batch8: dict[str, Any]              # a left-padded batch of 8 prompts for decode speed
    text_chunks: list[torch.Tensor]     # held-out Austen token chunks for perplexity
    calibration: list[dict[str, Any]]   # caption + text batches from the val splits (also rank blocks for removal)


class Bench:
    """Holds the model and the base's reference outputs; measures one method at a time against them."""

    def __init__(self, model, processor, data: EvalSet, new_tokens: int) -> None:
        self.model, self.processor, self.data, self.new_tokens = model, processor, data, new_tokens
        self.tokenizer = getattr(processor, "tokenizer", processor)
        from vlm_retrofit.callbacks import generation_pad_id

        self.pad = generation_pad_id(self.tokenizer)
        self.base: dict[str, Any] = {}
        self.base_method: Method = nullmethod
        self.tolerance = 0.02  # calibration: how close to each target the skipped fraction must come

    def _decode(self, tokens: torch.Tensor) -> str:
        return self.tokenizer.decode(tokens[0], skip_special_tokens=True).strip()

    def measure_base(self) -> dict[str, Any]:
        continuations, logits, captions = [], [], []
        for inputs in self.data.captions:
            tokens, _, _ = greedy(self.model, inputs, self.new_tokens, nullmethod, self.pad)
            continuations.append(tokens)
            logits.append(teacher_forced(self.model, inputs, tokens, nullmethod)[0])
            captions.append(self._decode(tokens))
        self.base = {
            "continuations": continuations, "logits": logits, "captions": captions,
            "ppl": perplexity(self.model, self.data.text_chunks, nullmethod),
            "rouge_l": rouge_l(captions, self.data.references),
            "speed_b1": decode_speed(self.model, self.data.captions[0], nullmethod, self.pad),
            "speed_b8": decode_speed(self.model, self.data.batch8, nullmethod, self.pad),
        }
        return {k: v for k, v in self.base.items() if isinstance(v, float)}

    def measure(self, method: Method, *, speed: bool) -> dict[str, Any]:
        agreement, kl, captions, reports = [], [], [], []
        for inputs, tokens, base_logits in zip(self.data.captions, self.base["continuations"], self.base["logits"]):
            _, agree, divergence = teacher_forced(self.model, inputs, tokens, method, base_logits)
            agreement.append(agree)
            kl.append(divergence)
            generated, report, _ = greedy(self.model, inputs, self.new_tokens, method, self.pad)
            captions.append(self._decode(generated))
            reports.append(report)
        result = {
            "agreement": sum(agreement) / len(agreement),
            "kl": sum(kl) / len(kl),
            "ppl_ratio": perplexity(self.model, self.data.text_chunks, method) / self.base["ppl"],
            "rouge_l": rouge_l(captions, self.data.references),
        }
        result["rouge_l_ratio"] = result["rouge_l"] / self.base["rouge_l"] if self.base["rouge_l"] else float("nan")
        if reports and all(hasattr(r, "executed_flops") for r in reports):
            from vlm_retrofit.skipping import SkipReport

            merged = SkipReport.merged(reports)
            result.update(compute_saved=merged.compute_saved, compute_saved_decode=merged.decode.compute_saved,
                          skipped_fraction=merged.skipped_layer_fraction)
        if speed:
            result["decode_speedup_b1"] = self.speed_ratio(self.data.captions[0], method)
            result["decode_speedup_b8"] = self.speed_ratio(self.data.batch8, method)
        return result

    def speed_ratio(self, inputs: dict[str, Any], method: Method, rounds: int = 2) -> float:
        """Decode tokens/s under `method` ÷ the base's, measured alternately in this call (machines are noisy).

        The base is the model with any attached routers disabled (`self.base_method`): the unmodified function.
        """
        base = other = 0.0
        for _ in range(rounds):
            base = max(base, decode_speed(self.model, inputs, self.base_method, self.pad, repeats=1))
            other = max(other, decode_speed(self.model, inputs, method, self.pad, repeats=1))
        return other / base


# -- the sweep ----------------------------------------------------------------------------------------------
def _record(method: str, target: float, metrics: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One operating point: the results.json keys first, then every other measurement; `extra` overrides."""
    keys = ("compute_saved", "agreement", "ppl_ratio", "rouge_l", "decode_speedup_b1", "decode_speedup_b8")
    merged = {**metrics, **extra}
    return {"method": method, "target": target, **{k: merged.get(k) for k in keys}, **merged}


def rank_blocks(model, calibration: list[dict[str, Any]], runs: Path, log: Callable[[str], None]) -> list[int]:
    """Skippable blocks by single-block removal impact (KL on the val calibration batches), cached on disk.

    One order serves static greedy removal and the removal schedule of the `routed_static` variants, so at
    init those variants *are* static greedy removal: any difference is what training the routers bought.
    """
    from vlm_retrofit import RouterConfig, attach_routers
    from vlm_retrofit.skipping import removal_impact

    path = runs / "removal_order.json"
    if path.is_file():
        return json.loads(path.read_text())["order"]
    identity = attach_routers(model, RouterConfig(block_size=1))
    impact = removal_impact(identity, calibration)
    identity.detach()
    order = sorted(impact, key=impact.__getitem__)
    log("single-block removal impact (KL per token, val): " + ", ".join(f"{b}:{impact[b]:.3f}" for b in order))
    runs.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"order": order, "impact": impact}, indent=2) + "\n")
    return order


def sweep(bench: Bench, targets: list[float], variants: list[Variant], speed_target: float, removal_order: list[int],
          load_model: Callable[[], Any], runs: Path, log: Callable[[str], None]) -> tuple[list[dict[str, Any]], float | None]:
    """Every method at every target, one record each; plus the router overhead with skipping off."""
    from vlm_retrofit import RouterAdapter, RouterConfig, attach_routers, calibrate

    from .baselines import UpdateOracle

    model, data, records = bench.model, bench.data, []
    overhead = None
    for variant in variants:
        adapter_dir = runs / variant.name / "adapter"
        lora_dir = adapter_dir / "lora"
        target_model = model
        if lora_dir.is_dir():
            # As shipped: LoRA merged into a copy of the base (`merge --merge-lora`); references stay the base's.
            from peft import PeftModel

            target_model = PeftModel.from_pretrained(load_model(), lora_dir).merge_and_unload().eval()
            bench.model = target_model
        adapter = RouterAdapter.from_pretrained(target_model, adapter_dir)
        bench.base_method = adapter.disabled  # merged LoRA stays in it: speed ratios compare skipping alone
        if overhead is None and target_model is model:
            # Retrofit time ÷ base time with skipping off: routers attached vs disabled, measured alternately.
            overhead = 1.0 / bench.speed_ratio(data.captions[0], nullmethod, rounds=3)
        # Trained routers with skipping off: what the retrofit itself costs before any block is skipped.
        records.append(_record(f"ours-{variant.name}", 0.0, bench.measure(nullmethod, speed=False), compute_saved=0.0))
        log(f"ours-{variant.name} routers only: {records[-1]}")
        for target in targets:
            settings = calibrate(adapter, data.calibration, target, variant.policy, store=False,
                                 tolerance=bench.tolerance).settings
            metrics = bench.measure(lambda: adapter.skipping(variant.policy, **settings), speed=target == speed_target)
            records.append(_record(f"ours-{variant.name}", target, metrics))
            log(f"ours-{variant.name} @ {target:.2f}: {records[-1]}")
        adapter.detach()
        bench.model = model
        del target_model
    bench.base_method = nullmethod

    identity = attach_routers(model, RouterConfig(block_size=1))  # routers at init: plain layer dropping
    bench.base_method = identity.disabled
    layout = identity.layout
    for target in targets:
        for name, order in (("static-block-influence", None), ("static-greedy-impact", removal_order)):
            settings = calibrate(identity, data.calibration, target, "static", store=False, order=order).settings
            metrics = bench.measure(lambda s=settings: identity.skipping("static", **s), speed=target == speed_target)
            records.append(_record(name, target, metrics, blocks=settings["blocks"]))
            log(f"{name} @ {target:.2f}: {records[-1]}")
        settings = calibrate(identity, data.calibration, target, "random", store=False,
                             tolerance=bench.tolerance).settings
        metrics = bench.measure(lambda s=settings: identity.skipping("random", **s), speed=target == speed_target)
        records.append(_record("random", target, metrics))
        log(f"random @ {target:.2f}: {records[-1]}")
    skippable_layers = [i for b in layout.skippable_blocks for i in layout.layers_of_block(b)]
    identity.detach()
    bench.base_method = nullmethod

    oracle = UpdateOracle(model, skippable_layers, identity.spec.get_layers(model))
    for target in targets:
        oracle.calibrate(data.calibration, target * layout.num_layers / len(skippable_layers))
        oracle.skipped = oracle.total = 0
        metrics = bench.measure(oracle.skipping, speed=False)
        metrics["skipped_fraction"] = oracle.skip_fraction * len(skippable_layers) / layout.num_layers
        records.append(_record("oracle-update (runs every layer)", target, metrics))
        log(f"oracle @ {target:.2f}: {records[-1]}")
    return records, overhead


# -- report -------------------------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 3) -> str:
    return "–" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


def write_report(results: dict[str, Any], out_dir: Path) -> None:
    """results.json, RESULTS.md (tables) and pareto.png (compute saved vs quality, one curve per method)."""
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in results["records"]})
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in methods:
        rows = sorted((r for r in results["records"] if r["method"] == method), key=lambda r: r["target"])
        x = [r.get("compute_saved") if r.get("compute_saved") is not None else r.get("skipped_fraction", r["target"])
             for r in rows]
        axes[0].plot(x, [r["ppl_ratio"] for r in rows], marker="o", label=method)
        axes[1].plot(x, [r["agreement"] for r in rows], marker="o", label=method)
    axes[0].set(xlabel="decoder-block compute saved", ylabel="held-out perplexity ratio vs base", yscale="log")
    axes[1].set(xlabel="decoder-block compute saved", ylabel="top-1 agreement with base (teacher-forced)")
    axes[1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out_dir / "pareto.png", dpi=110)
    plt.close(figure)

    lines = [
        "# Benchmark results",
        "",
        f"Run {results['date']} on {results['machine']}; backbone: {results['backbone']}.",
        "Generated by `make bench` (`python -m bench.run`); numbers below are copied from `results.json`.",
        "",
        f"* base: held-out Austen perplexity {results['base']['ppl']:.2f}, caption ROUGE-L {results['base']['rouge_l']:.3f}, "
        f"decode {results['base']['speed_b1']:.1f} tok/s (batch 1), {results['base']['speed_b8']:.1f} tok/s (batch 8)",
        f"* router overhead with skipping off (retrofit ÷ base decode time, batch 1): {_fmt(results['router_overhead'])}",
    ]
    for name, info in results["training"].items():
        lines.append(f"* training `{name}`: {info['steps']} steps in {info['minutes']} min, "
                     f"{info['step_seconds']:.2f} s/step (batch {info['batch_size']}), peak RSS {info['peak_rss_mb']:.0f} MB")
    lines += ["", "![compute saved vs quality](pareto.png)", "",
              "| method | target | compute saved (FLOPs, B=1 generate) | saved in decode | layer executions skipped | "
              "agreement | KL | ppl ratio | ROUGE-L | ROUGE-L ÷ base | decode ×base B=1 | B=8 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results["records"], key=lambda r: (r["target"], r["method"])):
        lines.append(" | ".join(["", r["method"], _fmt(r["target"], 2), _fmt(r.get("compute_saved")),
                                 _fmt(r.get("compute_saved_decode")), _fmt(r.get("skipped_fraction")),
                                 _fmt(r["agreement"]), _fmt(r.get("kl")), _fmt(r["ppl_ratio"]), _fmt(r["rouge_l"]),
                                 _fmt(r.get("rouge_l_ratio")), _fmt(r.get("decode_speedup_b1")),
                                 _fmt(r.get("decode_speedup_b8")), ""]).strip())
    lines += ["", results.get("notes", "")]
    (out_dir / "RESULTS.md").write_text("\n".join(lines).rstrip() + "\n")


# -- set-up and entry point ---------------------------------------------------------------------------------
def _prompt_inputs(processor, images: list, *, batch: bool = False) -> dict[str, Any]:
    from .real_vlm import caption_messages

    texts = [processor.apply_chat_template(caption_messages(image), add_generation_prompt=True, tokenize=False)
             for image in images]
    return dict(processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt"))


def _chunks(tokenizer, text: str, length: int, count: int) -> list[torch.Tensor]:
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][:count]


def build_eval_set(processor, manifest: dict[str, Any], args) -> EvalSet:
    from vlm_retrofit.batch import model_inputs
    from vlm_retrofit.datamodules import WebDatasetDataModule

    from .data import tuxpaint_split
    from .real_vlm import load_image

    tokenizer = getattr(processor, "tokenizer", processor)
    test = tuxpaint_split("test")[: args.caption_samples]
    images = [load_image(path) for path, _ in test]
    captions = [_prompt_inputs(processor, [image]) for image in images]
    calibration = []
    for name in ("captions-val", "austen-val"):
        data = WebDatasetDataModule(processor=args.backbone, val_shards=manifest["shards"][name]["dir"],
                                    train_shards=manifest["shards"][name]["dir"], batch_size=4, num_workers=0,
                                    max_length=384, add_quality_callback=False)
        data.setup("validate")
        for batch, _ in zip(data.val_dataloader(), range(args.calibration_batches)):
            calibration.append(model_inputs(batch))
    text = Path(manifest["austen_test"]["path"]).read_text()
    def to(inputs: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    return EvalSet(captions=[to(c) for c in captions], references=[caption for _, caption in test],
                   batch8=to(_prompt_inputs(processor, (images * 8)[:8])),
                   text_chunks=[c.to(args.device) for c in _chunks(tokenizer, text, args.chunk_tokens, args.text_chunks)],
                   calibration=[to(b) for b in calibration])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--variants", nargs="+",
                        default=["routed_static", "routed_static_lora", "routed_static_lora_fixed", "gate", "recent_weight"],
                        choices=sorted(VARIANTS))
    parser.add_argument("--train-minutes", type=float, default=15.0, help="distillation budget per variant (wall clock)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.1, 0.2, 0.3],
                        help="fractions of decoder-layer executions to skip (matched across methods)")
    parser.add_argument("--speed-target", type=float, default=0.2, help="target at which decode speed is measured")
    parser.add_argument("--caption-samples", type=int, default=20, help="test images for agreement / ROUGE-L")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--text-chunks", type=int, default=8, help="held-out Austen chunks for perplexity")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--calibration-batches", type=int, default=2, help="per modality, from the val splits")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (training and every measurement)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the frozen weights (routers stay fp32)")
    parser.add_argument("--runs", default=str(RUNS), help="trained adapters (reused when present: delete to retrain)")
    parser.add_argument("--out", default=str(ROOT), help="where RESULTS.md, results.json and pareto.png go")
    args = parser.parse_args(argv)
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
    from .real_vlm import build_real_vlm, load_real_vlm

    manifest = write_bench_shards()
    args.backbone = str(build_real_vlm())
    log(f"assets ready: real VLM at {args.backbone}; shards in {manifest['root']}")
    # 12 caption shards (~147 samples each) beside 24 Austen shards (200 each): ~27 % of samples are captions.
    shards = {"train": [manifest["shards"]["captions-train"]["dir"]] * 6 + [manifest["shards"]["austen-train"]["dir"]],
              "val": manifest["shards"]["captions-val"]["dir"]}
    dtype = getattr(torch, args.dtype)

    def load_model():
        return load_real_vlm(dtype=dtype)[0].to(args.device).eval()

    model, processor = load_real_vlm(dtype=dtype)
    model = model.to(args.device).eval()
    data = build_eval_set(processor, manifest, args)
    runs = Path(args.runs)
    removal_order = rank_blocks(model, data.calibration, runs, log)
    # The schedule covers every target: enough single-layer blocks to remove the largest target's share.
    num_layers = model.config.get_text_config().num_hidden_layers
    max_removed_blocks = min(len(removal_order), math.ceil(max(args.targets) * num_layers - 1e-9))
    speed_removed_blocks = min(len(removal_order), math.ceil(args.speed_target * num_layers - 1e-9))
    variants = [VARIANTS[name] for name in args.variants]
    training = {}
    for variant in variants:
        log(f"training {variant.name} for {args.train_minutes} min")
        training[variant.name] = train_variant(
            variant, args.backbone, shards, args.train_minutes, args.batch_size, removal_order=removal_order,
            max_removed_blocks=max_removed_blocks, speed_removed_blocks=speed_removed_blocks, runs=runs, device=args.device,
            dtype=None if args.dtype == "float32" else args.dtype)
        log(f"trained {variant.name}: {training[variant.name]}")

    bench = Bench(model, processor, data, args.new_tokens)
    base = bench.measure_base()
    log(f"base: {base}")
    records, overhead = sweep(bench, args.targets, variants, args.speed_target, removal_order, load_model, runs, log)
    import platform

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
                    + (f", GPU {torch.cuda.get_device_name()} ({args.dtype})" if args.device.startswith("cuda") else "")),
        "backbone": "SmolLM2-135M-Instruct + EfficientNet-Lite0 features + trained LLaVA projector (bench/real_vlm.py)",
        "base": base,
        "router_overhead": overhead,
        "training": training,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "runs")},
        "records": records,
        "seconds": round(time.time() - started, 1),
    }
    write_report(results, Path(args.out))
    log(f"wrote {Path(args.out) / 'RESULTS.md'} and results.json in {results['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
