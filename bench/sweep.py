"""Measuring on the real VLM: the eval set, one method at a time against the base, the sweep over methods."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vlm_retrofit.batch import on_device
from vlm_retrofit.text_metrics import rouge_l

from .evaluate import (Method, decode_speed, greedy, nullmethod, paired_speed_ratios, perplexity, routing_share,
                       speed_ratio, teacher_forced)


# Per-token policies skip only the cheapest blocks by single-block removal impact: this many times as many as a
# static removal at the same target takes (rounded up). Chosen on val text at the 20 % target: over the 6 / 9 / 12
# cheapest layers random per-token skipping raised perplexity x1.80 / x1.92 / x2.15, the update oracle (6 = the
# static removal) x1.80 / x1.66 / x1.78, and the trained `gate` x2.23 at 9 and x2.34 at 12; spread over all 28
# skippable layers random skipping cost x36.
CANDIDATE_FACTOR = 1.5

# Per-token variants keep image positions from skipping (`calibrate(skip_image_positions=False)`); the caption
# target then counts text positions. A batch-1 prefill saves a block only where every prompt token skips it, so
# skipping the 49 image positions saved almost nothing, yet every caption token reads their keys and values. Chosen on
# val captions (24 images): `gate_b3_candidates` at 10 % read agreement 0.744 / KL 0.569 with them kept, against
# 0.672 / 0.743 with them skipping, at the same 10.3 % of text positions skipped. The random and oracle baselines
# follow the same rule, so every per-token row is matched on the positions it may skip.

# Our per-token rows are calibrated on the answer tokens (`calibrate(counted_on="response")`), what a decode runs
# (`--counted-on text`: on every text position, as the runs before 2026-12-06). The random and oracle baselines are
# calibrated the same way, per workload (records from 2026-12-06 on; earlier ones counted text positions on the
# pooled calibration batches).
# Calibrated on every text position, the caption batches' chat template and prompt (~80 % of them) took most of the
# skipping: `gate_lora_candidates` at 20 % skipped 21 % of the prompt's layer executions, 4 % of the answers' (val).
OURS_COUNTED_ON = "response"
SKIP_IMAGE_POSITIONS = False


def candidate_count(layout, target: float) -> int:
    """How many blocks a per-token policy may skip at `target`: CANDIDATE_FACTOR x the blocks a static removal takes."""
    from vlm_retrofit.skipping import static_prefix

    static = len(static_prefix(list(layout.skippable_blocks), layout, target))
    return min(len(layout.skippable_blocks), math.ceil(CANDIDATE_FACTOR * static - 1e-9))


CANDIDATE_RULES = ("scaled", "trained")
"""How a measured adapter's per-token candidates are chosen at each target: `candidate_count` of the cheapest blocks,
those its skipping was trained on first (scaled), or the blocks its skipping was trained on (`skip_candidates`) at
every target (trained; scaled for an adapter trained on every block)."""


def candidates_at(adapter, order: list[int], target: float, rule: str = "scaled") -> list[int]:
    """The blocks a per-token policy of `adapter` may skip at `target` under `rule` (`CANDIDATE_RULES`): the
    first `candidate_count` of `order` (its trained `skip_candidates` first), or its own `skip_candidates`."""
    from vlm_retrofit.skipping import candidate_blocks

    if rule not in CANDIDATE_RULES:
        raise ValueError(f"candidate rule must be one of {CANDIDATE_RULES}, got {rule!r}")
    if rule == "trained" and adapter.skip_candidates:
        return list(candidate_blocks(adapter, [], adapter.skip_candidates))
    return list(candidate_blocks(adapter, [], candidate_count(adapter.layout, target), order=order))


# What the cached removal searches scored (vlm_retrofit.skipping.calibrate.scored_positions); earlier caches
# scored image positions too and are searched again.
SCORED_ON = "real text positions"


# -- measuring ---------------------------------------------------------------------------------------------
@dataclass
class EvalSet:
    captions: list[dict[str, Any]]      # B=1 prompt inputs, one per test image (val: `bench.measure --eval-split`)
    references: list[str]
    batch8: dict[str, Any]              # a left-padded batch of 8 prompts for decode speed
    text_chunks: list[torch.Tensor]     # held-out (test, or val) Austen token chunks for perplexity
    calibration: list[dict[str, Any]]   # caption + text batches from the val splits (also rank blocks for removal)
    calibration_by_workload: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Val batches by workload: "captions" (the caption batches of `calibration`, with the datamodule's `loss_mask`
    marking the answer tokens) and "text" (raw val text chunked like `text_chunks`, every position an answer
    token). Per-token policies are calibrated on the workload each measurement runs (empty: on `calibration` for
    both)."""
    replacement_calibration: list[tuple[dict[str, Any], torch.Tensor]] = field(default_factory=list)
    """(inputs, real-token mask) batches from the *train* splits that the training-free linear replacement
    baseline is fitted on (empty: that baseline is not measured)."""

    def workloads(self) -> dict[str, list[dict[str, Any]]]:
        """The batches a per-token policy is calibrated on for each workload ("captions", "text"):
        `calibration_by_workload`, else the pooled `calibration` for both."""
        return self.calibration_by_workload or {"captions": self.calibration, "text": self.calibration}

    def per_workload(self, calibrated: Callable[[list[dict[str, Any]]], Any]) -> dict[str, Any]:
        """`calibrated(batches)` for each workload's batches (`workloads`), called once where workloads share them
        (the pooled fallback): the same calibration twice would only repeat its forwards."""
        results: dict[int, Any] = {}
        by_workload = {}
        for workload, batches in self.workloads().items():
            if id(batches) not in results:
                results[id(batches)] = calibrated(batches)
            by_workload[workload] = results[id(batches)]
        return by_workload


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
        self.speed_rounds = 4  # paired rounds (base and method side by side) per decode-speed ratio
        self.counted_on = OURS_COUNTED_ON  # where our per-token policies' targets are counted (`--counted-on`)
        self.unit = "layers"  # what a measured adapter's targets count (`bench.measure --unit`; calibrate's `unit`)
        self.allocation = "equal"  # how per-token skipping is spread over candidate blocks (calibrate's `allocation`)
        self.candidate_rule = "scaled"  # which blocks a measured adapter's per-token policy may skip (CANDIDATE_RULES)

    @property
    def per_token_counted_on(self) -> str | None:
        """Where per-token calibrations count their target: `counted_on` given workload batches (they carry the
        answers' `loss_mask`), else None (calibrate's default for the adapter)."""
        return self.counted_on if self.data.calibration_by_workload else None

    def _decode(self, tokens: torch.Tensor) -> str:
        return self.tokenizer.decode(tokens[0], skip_special_tokens=True).strip()

    def measure_base(self) -> dict[str, Any]:
        """Runs the base on the eval set and keeps its outputs; returns its metrics and its continuations' hash."""
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
        # The continuations' hash names the build measured: a rebuilt projector changes the captions, not the ppl.
        return {**{k: v for k, v in self.base.items() if isinstance(v, float)},
                "continuations": self.fingerprint()["continuations"]}

    def measure(self, method: Method, *, speed: bool, text_method: Method | None = None) -> dict[str, Any]:
        """Quality under `method` (on the Austen chunks under `text_method` when given: a per-token policy
        calibrated on text), and the fraction of layer executions it realised in each workload: a per-token
        policy realises another fraction on each workload than on the batches it was calibrated on
        (`ppl_skipped_fraction`: the Austen chunks; `tf_skipped_fraction`: the whole teacher-forced caption passes,
        prompt and continuation, whose continuation positions give agreement and KL; `tf_skipped_text_fraction`: the
        same passes' text positions, image placeholders left out; `skipped_fraction`: the greedy captions). Each pass
        is one unpadded sequence, so every position counts."""
        agreement, kl, captions, reports, forced_reports, ppl_reports = [], [], [], [], [], []
        for inputs, tokens, base_logits in zip(self.data.captions, self.base["continuations"], self.base["logits"]):
            _, agree, divergence = teacher_forced(self.model, inputs, tokens, method, base_logits, forced_reports)
            agreement.append(agree)
            kl.append(divergence)
            generated, report, _ = greedy(self.model, inputs, self.new_tokens, method, self.pad)
            captions.append(self._decode(generated))
            reports.append(report)
        result = {
            "agreement": sum(agreement) / len(agreement),
            # Per caption, in eval-set order: what a paired comparison of two rows resamples (report.py).
            "agreement_per_caption": [round(value, 4) for value in agreement],
            "kl": sum(kl) / len(kl),
            "ppl_ratio": perplexity(self.model, self.data.text_chunks, text_method or method, ppl_reports)
            / self.base["ppl"],
            "rouge_l": rouge_l(captions, self.data.references),
        }
        result["rouge_l_ratio"] = result["rouge_l"] / self.base["rouge_l"] if self.base["rouge_l"] else float("nan")
        for key, workload, counted in (("skipped_fraction", reports, "skipped_layer_fraction"),
                                       ("tf_skipped_fraction", forced_reports, "skipped_layer_fraction"),
                                       ("tf_skipped_text_fraction", forced_reports, "skipped_text_layer_fraction"),
                                       ("ppl_skipped_fraction", ppl_reports, "skipped_layer_fraction")):
            fraction = realised_skipped_fraction(workload, counted)
            if fraction is not None:
                result[key] = fraction
        if reports and all(hasattr(r, "executed_flops") for r in reports):
            from vlm_retrofit.skipping import SkipReport

            merged = SkipReport.merged(reports)
            result.update(compute_saved=merged.compute_saved, compute_saved_decode=merged.decode.compute_saved)
        if speed:
            result.update(self.measure_speed(method))
        return result

    def measure_speed(self, method: Method) -> dict[str, Any]:
        """Decode speed under `method` as a ratio to the base's, at batch 1 and batch 8: the median of
        `speed_rounds` paired rounds (ABBA order), with the lowest and highest round beside it."""
        result: dict[str, Any] = {}
        for key, inputs in (("b1", self.data.captions[0]), ("b8", self.data.batch8)):
            ratios = paired_speed_ratios(self.model, inputs, method, self.base_method, self.pad,
                                         rounds=self.speed_rounds)
            result[f"decode_speedup_{key}"] = statistics.median(ratios)
            result[f"decode_speedup_{key}_range"] = [min(ratios), max(ratios)]
        return result

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the model and eval set: the base's metrics and a hash of its greedy continuations."""
        digest = hashlib.sha256()
        for tokens in self.base["continuations"]:
            digest.update(tokens.cpu().numpy().tobytes())
        return {"ppl": round(self.base["ppl"], 4), "rouge_l": round(self.base["rouge_l"], 4),
                "continuations": digest.hexdigest()[:16]}

    def speed_ratio(self, inputs: dict[str, Any], method: Method, rounds: int | None = None) -> float:
        """Decode tokens/s under `method` ÷ the base's, measured alternately in this call (`speed_ratio`).

        The base is the model with any attached routers' hooks taken off (`self.base_method`, `unhooked`): the
        unmodified function, without the hooks' dispatch either.
        """
        return speed_ratio(self.model, inputs, method, self.base_method, self.pad, rounds=rounds or self.speed_rounds)


def realised_skipped_fraction(reports: list, counted: str = "skipped_layer_fraction") -> float | None:
    """Token-weighted fraction of decoder-layer executions skipped over several passes, from what the method
    yielded in each (`SkipReport`s, or the update oracle's counts); None when it yields no count (the base).
    `counted="skipped_text_layer_fraction"`: over real text positions only (`SkipReport`s only)."""
    if not reports or any(r is None or not hasattr(r, counted) for r in reports):
        return None
    return getattr(type(reports[0]).merged(reports), counted)


def with_replacement(method: Method, model, spec, replacement, layers: list[int]) -> tuple[Method, bool]:
    """`method` with a replacement (linear maps or layer replacements, and the layers they were fitted for) folded
    into the weights while it runs, when `layers` are exactly the removed layers it was fitted for; else `method`
    unchanged. (method, applied)"""
    if replacement is None or sorted(layers) != sorted(replacement[1]):
        return method, False
    from vlm_retrofit.replacement import replacements_folded

    @contextlib.contextmanager
    def replaced():
        with replacements_folded(model, spec, replacement[0]), method() as report:
            yield report

    return replaced, True


def _record(method: str, target: float, metrics: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One operating point: the results.json keys first, then every other measurement; `extra` overrides."""
    keys = ("compute_saved", "agreement", "ppl_ratio", "rouge_l", "decode_speedup_b1", "decode_speedup_b8")
    merged = {**metrics, **extra}
    return {"method": method, "target": target, **{k: merged.get(k) for k in keys}, **merged}


def search_key(model, calibration: list[dict[str, Any]]) -> dict[str, str]:
    """What a removal search's result depends on besides its own settings: the positions it scores, the
    calibration batches (their tensors) and the model (its dtype, and a digest of every parameter's sum; a rebuilt
    projector changes it). Cached orders are reused only under the same key."""
    batches = hashlib.sha256()
    for batch in calibration:
        for name in sorted(batch):
            value = batch[name]
            if isinstance(value, torch.Tensor):
                batches.update(name.encode())
                batches.update((value.float() if value.is_floating_point() else value).detach().cpu().numpy().tobytes())
    parameters = list(model.parameters())
    sums = torch.stack([p.detach().float().sum() for p in parameters]).cpu().numpy().tobytes()
    return {"scored_on": SCORED_ON, "calibration": batches.hexdigest()[:16],
            "model": f"{parameters[0].dtype}:{hashlib.sha256(sums).hexdigest()[:16]}"}


def rank_blocks(model, calibration: list[dict[str, Any]], runs: Path, log: Callable[[str], None], *,
                key: dict[str, str] | None = None) -> list[int]:
    """Skippable blocks by single-block removal impact (KL on the val calibration batches), cached on disk under
    `key` (default: `search_key` of the model and batches, which a caller running several searches computes once).

    One order serves static greedy removal and the removal schedule of the `routed_static` variants, so at
    init those variants *are* static greedy removal: any difference is what training the routers bought.
    """
    from vlm_retrofit import RouterConfig, attach_routers
    from vlm_retrofit.skipping import removal_impact

    path = runs / "removal_order.json"
    key = key or search_key(model, calibration)
    if path.is_file() and json.loads(path.read_text()).get("key") == key:
        return json.loads(path.read_text())["order"]
    identity = attach_routers(model, RouterConfig(block_size=1))
    impact = removal_impact(identity, calibration)
    identity.detach()
    order = sorted(impact, key=impact.__getitem__)
    log("single-block removal impact (KL per token, val): " + ", ".join(f"{b}:{impact[b]:.3f}" for b in order))
    runs.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"order": order, "impact": impact, "key": key}, indent=2) + "\n")
    return order


def joint_removal_order(model, calibration: list[dict[str, Any]], removal_order: list[int], num_blocks: int,
                        runs: Path, log: Callable[[str], None], candidates: int = 14, *,
                        key: dict[str, str] | None = None) -> list[int]:
    """The first `num_blocks` blocks of greedy joint removal (KL on the val calibration batches), cached on disk
    (under `key`, as `rank_blocks`).

    The search is narrowed to the `candidates` cheapest blocks by single-block impact (the others cost 1.5-10x
    more alone): ~num_blocks x candidates passes over the calibration batches.
    """
    from vlm_retrofit import RouterConfig, attach_routers
    from vlm_retrofit.skipping import greedy_removal_order

    path = runs / "joint_removal_order.json"
    pool = removal_order[:candidates]
    key = key or search_key(model, calibration)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["candidates"] == pool and len(saved["order"]) >= num_blocks and saved.get("key") == key:
            return saved["order"][:num_blocks]
    identity = attach_routers(model, RouterConfig(block_size=1))
    order, costs = greedy_removal_order(identity, calibration, num_blocks, candidates=pool)
    identity.detach()
    log("greedy joint removal (KL per token after each pick, val): " + ", ".join(f"{b}:{c:.3f}" for b, c in zip(order, costs)))
    path.write_text(json.dumps({"order": order, "kl": costs, "candidates": pool, "key": key}, indent=2) + "\n")
    return order


def span_removal_order(model, calibration: list[dict[str, Any]], removal_order: list[int], span_blocks: int,
                       num_blocks: int, runs: Path, log: Callable[[str], None], candidates: int = 14, *,
                       key: dict[str, str] | None = None) -> list[int]:
    """The run of `span_blocks` adjacent blocks whose removal costs the least KL on the val calibration batches
    (ordered by single-block impact), then greedy joint removal continued from it among the `candidates` cheapest
    blocks up to `num_blocks`; cached on disk (under `key`, as `rank_blocks`; one file per span length). Greedy
    joint removal adds one block at a time and can miss sets whose members are costly alone but cheap together; a
    span is scored whole."""
    from vlm_retrofit import RouterConfig, attach_routers
    from vlm_retrofit.skipping import best_removal_span, greedy_removal_order

    path = runs / f"span_removal_order-{span_blocks}.json"
    pool = removal_order[:candidates]
    key = key or search_key(model, calibration)
    if path.is_file():
        saved = json.loads(path.read_text())
        if (saved["candidates"] == pool and saved["span_blocks"] == span_blocks and len(saved["order"]) >= num_blocks
                and saved.get("key") == key):
            return saved["order"][:num_blocks]
    identity = attach_routers(model, RouterConfig(block_size=1))
    span, costs = best_removal_span(identity, calibration, span_blocks)
    span = [b for b in removal_order if b in span]
    order, kl = (greedy_removal_order(identity, calibration, num_blocks, candidates=pool, start=span)
                 if num_blocks > span_blocks else (span, []))
    identity.detach()
    cheapest = sorted(costs, key=costs.__getitem__)[:3]
    log(f"removal spans of {span_blocks} (KL per token, val; the cheapest 3 by first block): "
        + ", ".join(f"{b}:{costs[b]:.3f}" for b in cheapest)
        + "; then greedy joint: " + ", ".join(f"{b}:{c:.3f}" for b, c in zip(order[len(span):], kl[len(span):])))
    runs.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"order": order, "span_blocks": span_blocks, "span_kl": costs, "kl": kl,
                                "candidates": pool, "key": key}, indent=2) + "\n")
    return order[:num_blocks]


def sweep(bench: Bench, targets: list[float], variants: list, speed_target: float, removal_order: list[int],
          joint_order: list[int], load_model: Callable[[], Any], runs: Path, log: Callable[[str], None], *,
          baseline_key: dict[str, Any] | None = None, reuse_baselines: bool = False, span_order: list[int] | None = None,
          reuse_measured: bool = False, machine: str = "") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every method at every target, one record each (a variant trained for one target, `removal_target`, at that
    target only, its decode speed measured there); plus the router overhead with skipping off
    (`router_overhead`: wall-clock ratio to the base; `router_time_share`: routing's share of a routed decode).

    Each variant's records are kept beside its adapter (`bench.resume`); with `reuse_measured`, a variant an earlier
    run measured under the same key (settings, `machine`, base outputs, targets, policy, trained adapter) is taken
    from there whole, its decode speed included (records say `measured_in_earlier_run`), so a stopped run goes on
    where it stopped; except a variant the router overhead would be measured on here, and was not there."""
    from .resume import earlier_measurement, measured_key, store_measurement

    records: list[dict[str, Any]] = []
    overhead: dict[str, Any] = {"router_overhead": None, "router_time_share": None}
    for variant in variants:
        own = variant.removal_target  # one adapter per operating point: measured at its own target only
        variant_targets, variant_speed_target = (targets, speed_target) if own is None else ([own], own)
        folder = runs / variant.name
        settings = {**(baseline_key or {}), "machine": machine, "policy": variant.policy,
                    "per_token": {"candidate_factor": CANDIDATE_FACTOR, "skip_image_positions": SKIP_IMAGE_POSITIONS}}
        key = measured_key(bench, folder, variant_targets, variant_speed_target, removal_order, settings)
        earlier = earlier_measurement(folder, key) if reuse_measured else None
        if (earlier is not None and overhead["router_overhead"] is None and not earlier["overhead"]
                and not (folder / "adapter" / "lora").is_dir()):
            earlier = None  # routers on the base itself, and no overhead yet: measured here, as a fresh run would
        if earlier is not None:
            log(f"{variant.name}: reusing the records an earlier run measured ({folder / 'measured.json'})")
            records += [{**record, "measured_in_earlier_run": True} for record in earlier["records"]]
            if overhead["router_overhead"] is None and earlier["overhead"]:
                overhead.update(earlier["overhead"])
            continue
        unmeasured = overhead["router_overhead"] is None
        measured = measure_adapter(bench, variant.name, variant.policy, folder / "adapter", variant_targets,
                                   variant_speed_target, removal_order, load_model, log, overhead=overhead)
        timed_here = unmeasured and overhead["router_overhead"] is not None  # on this variant's routers
        store_measurement(folder, key, measured, dict(overhead) if timed_here else None)
        records += measured
    overhead["router_overhead_by_block_size"] = router_overhead_by_block_size(bench)
    log(f"router overhead by block size (routers at init): {overhead['router_overhead_by_block_size']}")
    records += measure_baselines(bench, targets, speed_target, removal_order, joint_order, log, cache=runs / "baselines.json",
                                 key=baseline_key or {}, reuse=reuse_baselines, span_order=span_order)
    return records, overhead


OVERHEAD_ROUNDS = 24
"""Paired rounds behind each router overhead: a ratio of ~1.02 must be told from 1.00 on a machine whose adjacent
generate calls differ by a few per cent (routers disabled read 0.985-1.000x the plain model in 8 rounds)."""

OVERHEAD_BLOCK_SIZES = (1, 2, 3)


def router_overhead_by_block_size(bench: Bench, block_sizes: tuple[int, ...] = OVERHEAD_BLOCK_SIZES,
                                  rounds: int = OVERHEAD_ROUNDS) -> dict[str, dict[str, Any]]:
    """Routers at init with skipping off in front of every `block_size` layers of the bench's model, for each block
    size: decode time ÷ the plain model's (`overhead`) and routing's share of a routed generate call (`time_share`),
    on the first caption batch (batch 1). Trained routers cost the same: the fused kernels do the same work whatever
    the routers' values."""
    from vlm_retrofit import RouterConfig, attach_routers

    measured = {}
    for block_size in block_sizes:
        adapter = attach_routers(bench.model, RouterConfig(block_size=block_size))
        try:
            overhead, share = router_overhead(bench, adapter, rounds)
        finally:
            adapter.detach()
        measured[str(block_size)] = {"routers": len(adapter.routers), "overhead": round(overhead, 4),
                                     "time_share": round(share, 4)}
    return measured


def router_overhead(bench: Bench, adapter, rounds: int = OVERHEAD_ROUNDS) -> tuple[float, float]:
    """`adapter`'s routers with skipping off on the bench's first caption batch (batch 1): decode time ÷ the plain
    model's (its hooks off), and routing's share of a routed generate call."""
    inputs = bench.data.captions[0]
    ratio = speed_ratio(bench.model, inputs, nullmethod, adapter.unhooked, bench.pad, rounds=rounds)
    return 1.0 / ratio, routing_share(bench.model, adapter, inputs, bench.pad, rounds=3)


def load_as_shipped(adapter_dir: Path, model, load_model: Callable[[], Any]) -> tuple[Any, Any]:
    """A trained adapter folder on `model`, as shipped: a LoRA in its `lora/` merged into a copy of the base
    (`load_model()`, as `merge --merge-lora` does), the routers attached to that copy with `model` as the reference
    (a merged LoRA may train norms). (the model the adapter runs on, the `RouterAdapter`)"""
    from vlm_retrofit import RouterAdapter

    target_model = model
    if (adapter_dir / "lora").is_dir():
        from peft import PeftModel

        target_model = PeftModel.from_pretrained(load_model(), adapter_dir / "lora").merge_and_unload().eval()
    return target_model, RouterAdapter.from_pretrained(target_model, adapter_dir, base=model)


def measure_adapter(bench: Bench, name: str, policy: str, adapter_dir: Path, targets: list[float], speed_target: float,
                    removal_order: list[int], load_model: Callable[[], Any], log: Callable[[str], None], *,
                    overhead: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One trained adapter folder (`save_pretrained`; a LoRA in its `lora/`) under `policy` at every target, as the
    records `ours-<name>` (its routers with skipping off at target 0, then each target) and, for a LoRA-healed
    static adapter, `ours-<name>-pruned` (the pruned release). `removal_order` ranks the blocks per-token policies
    may skip (`cheapest_blocks`). When `overhead` is given and still unmeasured, the router overhead with skipping
    off is measured on these routers (only on routers without a merged LoRA: the base must be the same model)."""
    from vlm_retrofit.replacement import load_replacements

    model, data, records = bench.model, bench.data, []
    target_model, adapter = load_as_shipped(adapter_dir, model, load_model)
    bench.model = target_model
    replacement = load_replacements(adapter_dir)  # applied only where its layers are the ones removed
    bench.base_method = adapter.unhooked  # merged LoRA stays in it: speed ratios compare skipping alone
    if overhead is not None and overhead["router_overhead"] is None and target_model is model:
        # Retrofit time ÷ base time with skipping off: routers attached vs their hooks off, measured alternately.
        overhead["router_overhead"], overhead["router_time_share"] = router_overhead(bench, adapter)
        # The cost scales with the number of routers: say whose routers these are.
        overhead["router_overhead_measured_on"] = f"{name} (block size {adapter.config.block_size})"
    # Trained routers with skipping off: what the retrofit itself costs before any block is skipped.
    records.append(_record(f"ours-{name}", 0.0, bench.measure(nullmethod, speed=False), compute_saved=0.0))
    log(f"ours-{name} routers only: {records[-1]}")
    own_candidates = policy != "static" and bench.candidate_rule == "trained" and bool(adapter.skip_candidates)
    ranked = cheapest_blocks(adapter, data, removal_order) if policy != "static" and not own_candidates else []
    for target in targets:
        candidates = (candidates_at(adapter, ranked, target, bench.candidate_rule) if ranked or own_candidates
                      else None)
        settings = calibrated_per_workload(adapter, data, target, policy, bench.tolerance,
                                           candidates=candidates, skip_image_positions=SKIP_IMAGE_POSITIONS,
                                           counted_on=bench.per_token_counted_on, unit=bench.unit,
                                           allocation=bench.allocation)  # a static removal has none to spread
        methods, replaced = {}, False
        for workload, chosen in settings.items():
            methods[workload], replaced = with_replacement(
                lambda s=chosen: adapter.skipping(policy, **s), target_model, adapter.spec, replacement,
                adapter.layout.layers_of_blocks(chosen.get("blocks", [])))
        metrics = bench.measure(methods["captions"], text_method=methods["text"], speed=target == speed_target)
        extra = {"replacement": True} if replaced else {}
        if candidates is not None:
            extra["candidate_blocks"] = candidates
        if policy != "static" and not SKIP_IMAGE_POSITIONS:
            extra["image_positions"] = "run every block"
        if settings["captions"] != settings["text"]:
            extra["calibrated_on"] = "each workload's val batches"
        if policy != "static" and bench.per_token_counted_on:
            extra["counted_on"] = bench.per_token_counted_on
        if bench.unit != "layers":
            extra["target_unit"] = bench.unit
        if policy != "static" and bench.allocation != "equal":
            extra["allocation"] = bench.allocation
        if candidates is not None and bench.candidate_rule != "scaled":
            extra["candidate_rule"] = bench.candidate_rule
        records.append(_record(f"ours-{name}", target, metrics, **extra))
        log(f"ours-{name} @ {target:.2f}: {records[-1]}")
    order, layout, spec, router_config = adapter.removal_order, adapter.layout, adapter.spec, adapter.config
    adapter.detach()
    if policy == "static" and target_model is not model:
        records += measure_pruned(bench, f"ours-{name}-pruned", order, layout, spec, router_config,
                                  targets, speed_target, log, replacement=replacement)
    bench.model = model
    bench.base_method = nullmethod
    return records


def calibrated_per_workload(adapter, data: EvalSet, target: float, policy: str, tolerance: float, *,
                            candidates: list[int] | None = None, skip_image_positions: bool | None = None,
                            counted_on: str | None = None, unit: str = "layers",
                            allocation: str = "equal") -> dict[str, dict[str, Any]]:
    """`policy`'s settings at `target` for each workload ("captions", "text"), each calibrated on that workload's
    val batches, so that each realises the target where it is measured. Calibrated on both at once, a gate's
    thresholds skipped 36 % of the caption passes' layer executions and 5.5 % of the text's at the 20 % target.
    A static removal does not depend on the batches: one calibration serves both. A per-token policy skips only
    `candidates` (default: every skippable block), and image positions only with `skip_image_positions` (without,
    the caption target counts text positions); `counted_on="response"` counts the answer tokens instead (the
    workloads' `loss_mask`). `unit`: what the target counts, layer executions or decoder-layer FLOPs; `allocation`:
    how a per-token policy's skipping is spread over its candidate blocks (both calibrate's)."""
    from vlm_retrofit import calibrate

    if policy == "static":
        settings = calibrate(adapter, data.calibration, target, policy, store=False, unit=unit).settings
        return {workload: settings for workload in data.workloads()}
    return data.per_workload(lambda batches: calibrate(
        adapter, batches, target, policy, store=False, tolerance=tolerance, candidates=candidates,
        skip_image_positions=skip_image_positions, counted_on=counted_on, unit=unit, allocation=allocation).settings)


def cheapest_blocks(adapter, data: EvalSet, removal_order: list[int]) -> list[int]:
    """Skippable blocks of `adapter`, cheapest to remove first: `removal_order` (single layers ranked by removal
    impact in the base model on the pooled calibration batches) where its blocks are single layers, else ranked
    by removal impact through the adapter's own routers on the same batches. (A candidate count drawn from it
    takes the blocks the adapter's skipping was trained on first: `candidate_blocks`.)"""
    from vlm_retrofit.skipping import removal_impact

    if adapter.config.block_size == 1:
        ranked = [b for b in removal_order if b in adapter.layout.skippable_blocks]
    else:
        impact = removal_impact(adapter, data.calibration)
        ranked = sorted(impact, key=impact.__getitem__)
    return ranked


def measure_pruned(bench: Bench, name: str, order: list[int], layout, spec, router_config, targets: list[float],
                   speed_target: float, log: Callable[[str], None], *, replacement=None) -> list[dict[str, Any]]:
    """A LoRA-healed static variant shipped as a pruned release (`merge --prune-target`): the blocks the static
    policy removes at each target are deleted from the weights and the trained routers are dropped; a linear
    `replacement` (transforms, fitted layers) is folded into the weights at the target that removes its layers.

    Quality is measured through routers at identity removing the same blocks (what the pruned model computes;
    tests/test_pruning.py checks the equality), decode speed with the layers deleted and no routers attached.
    """
    from vlm_retrofit import attach_routers
    from vlm_retrofit.pruning import layers_removed
    from vlm_retrofit.skipping.calibrate import static_prefix

    records = []
    identity = attach_routers(bench.model, type(router_config).from_dict(router_config.to_dict()))
    for target in targets:
        blocks = static_prefix(list(order), layout, target)
        method, replaced = with_replacement(lambda b=blocks: identity.skipping("static", blocks=b), bench.model, spec,
                                            replacement, layout.layers_of_blocks(blocks))
        metrics = bench.measure(method, speed=False)
        records.append(_record(name, target, metrics, settings={"blocks": blocks},
                               **({"replacement": True} if replaced else {})))
        log(f"{name} @ {target:.2f}: {records[-1]}")
    identity.detach()
    bench.base_method = nullmethod  # the plain model is the base: no hooks on either side
    for record in records:
        if record["target"] == speed_target:
            layers = layout.layers_of_blocks(record["settings"]["blocks"])
            method, _ = with_replacement(lambda: layers_removed(bench.model, spec, layers), bench.model, spec,
                                         replacement, layers)
            record.update(bench.measure_speed(method),
                          speed_measured_as="layers deleted, no routers attached (the pruned release)")
            log(f"{name} @ {record['target']:.2f} decode: {record['decode_speedup_b1']:.3f}x (B=1), "
                f"{record['decode_speedup_b8']:.3f}x (B=8)")
    return records


def measure_baselines(bench: Bench, targets: list[float], speed_target: float, removal_order: list[int],
                      joint_order: list[int], log: Callable[[str], None], *, cache: Path, key: dict[str, Any], reuse: bool,
                      span_order: list[int] | None = None) -> list[dict[str, Any]]:
    """Static removal (Block Influence, greedy by single-block impact, greedy joint, greedy joint with a linear
    replacement of the removed spans, and, given `span_order`, the cheapest span continued greedily), random
    skipping and the update oracle at every target, each of the last two also restricted to the blocks our
    per-token policies may skip there (`candidate_count` of `removal_order`: "-cheapest").

    Their quality is a deterministic function of the model, the eval set and the settings. With `reuse`, the
    records of an earlier run with the same key (settings, removal order, the base's outputs) are taken from
    `cache` and only their decode speed is measured again, side by side with the base in this run. Every run
    stores its records in `cache` under its key, beside those of runs with other keys (other targets, say).
    """
    from vlm_retrofit import RouterConfig, attach_routers, calibrate
    from vlm_retrofit.pruning import layers_removed

    from .baselines import UpdateOracle
    from .resume import run_key

    model, data, records = bench.model, bench.data, []
    # Random and the oracle are calibrated per workload and counted where our per-token rows are (`--counted-on`).
    counted_on = bench.per_token_counted_on
    key = {**key, **run_key(bench, targets, speed_target, removal_order),
           "oracle_calibration": "bisected to the realised fraction",
           "skipping_recorded": "per workload; Block Influence on real text positions",
           "span_order": list(span_order or []),
           "per_token_baselines": ("image positions skip" if SKIP_IMAGE_POSITIONS else "image positions run every block")
           + "; random hashed on position and decoder-input bits"}
    stored = next((entry["records"] for entry in cached_baselines(cache) if entry["key"] == key), []) if reuse else []
    earlier = {(r["method"], r["target"]): r for r in stored}
    if reuse:
        log(f"baselines: reusing {len(earlier)} records from {cache}" if earlier else
            f"baselines: nothing to reuse in {cache} (missing, or measured with other settings): measuring all")

    identity = attach_routers(model, RouterConfig(block_size=1))  # routers at init: plain layer dropping
    bench.base_method = identity.unhooked
    layout = identity.layout

    deleted: list[dict[str, Any]] = []  # static records at the speed target: timed later without any routers

    def replaced_point(target: float) -> None:
        # ReplaceMe-style, training-free: the greedy joint removal, each removed span replaced by a least-squares
        # map folded into the layer in front of it, fitted on train-split batches. Same cost as plain removal.
        from vlm_retrofit.replacement import fit_replacements

        name = "static-greedy-joint-replaced"
        blocks = calibrate(identity, data.calibration, target, "static", store=False, order=joint_order).settings["blocks"]
        settings = {"blocks": blocks, "replacement_batches": len(data.replacement_calibration)}
        before = earlier.get((name, target))
        if before is not None and before.get("settings") == settings:
            records.append({**before, "quality_from_earlier_run": True})
        else:
            layers = layout.layers_of_blocks(blocks)
            with identity.disabled():
                transforms = fit_replacements(model, identity.spec, layers, data.replacement_calibration)
            method, _ = with_replacement(lambda: identity.skipping("static", blocks=blocks), model, identity.spec,
                                         (transforms, layers), layers)
            records.append(_record(name, target, bench.measure(method, speed=False), settings=settings))
        if target == speed_target:  # folding changes weights, not cost: timed as the plain removal is
            deleted.append(records[-1])
        log(f"{name} @ {target:.2f}: {records[-1]}")

    def point(name: str, target: float, policy: str, settings: Callable[[], dict[str, Any]],
              fixed: dict[str, Any] | None = None) -> None:
        # Static removal is timed as shipped (layers deleted, below); random needs the routing machinery.
        # `settings` gives a static removal's settings, or random's per workload (calibrated_per_workload).
        speed = target == speed_target and policy != "static"
        before = earlier.get((name, target))
        fresh_settings = settings() if policy == "static" else None  # cheap; an earlier record must match it
        if before is not None and fresh_settings is not None and before.get("settings") != fresh_settings:
            before = None
        if before is not None and fixed and any(before["settings"].get(k) != v for k, v in fixed.items()):
            before = None  # e.g. random skipping restricted to other candidate blocks
        if before is not None and policy != "static" and before.get("counted_on") != counted_on:
            before = None  # calibrated where the target counted other positions
        if before is None and policy == "static":
            chosen = fresh_settings
            records.append(_record(name, target, bench.measure(lambda: identity.skipping(policy, **chosen), speed=False),
                                   settings=chosen))
        elif before is None:
            per_workload = settings()
            chosen = per_workload["captions"]
            metrics = bench.measure(lambda: identity.skipping(policy, **chosen), speed=speed,
                                    text_method=lambda: identity.skipping(policy, **per_workload["text"]))
            records.append(_record(name, target, metrics, settings=chosen, text_settings=per_workload["text"],
                                   counted_on=counted_on))
        else:
            chosen = before["settings"]
            fresh = bench.measure_speed(lambda: identity.skipping(policy, **chosen)) if speed else {}
            records.append({**before, **fresh, "quality_from_earlier_run": True})
        if policy == "static" and target == speed_target:
            deleted.append(records[-1])
        log(f"{name} @ {target:.2f}: {records[-1]}")

    for target in targets:
        for name, order in (("static-block-influence", None), ("static-greedy-impact", removal_order),
                            ("static-greedy-joint", joint_order), *([("static-span", span_order)] if span_order else [])):
            point(name, target, "static", lambda o=order, t=target: calibrate(
                identity, data.calibration, t, "static", store=False, order=o).settings)
        point("random", target, "random", lambda t=target: calibrated_per_workload(
            identity, data, t, "random", bench.tolerance, skip_image_positions=SKIP_IMAGE_POSITIONS,
            counted_on=counted_on))
        # Random skipping over the blocks our per-token policies may skip: what their learned signal must beat.
        cheap = candidates_at(identity, removal_order, target)
        point("random-cheapest", target, "random", lambda t=target, c=cheap: calibrated_per_workload(
            identity, data, t, "random", bench.tolerance, candidates=c, skip_image_positions=SKIP_IMAGE_POSITIONS,
            counted_on=counted_on), fixed={"blocks": cheap})
        if data.replacement_calibration:
            replaced_point(target)
    skippable_layers = layout.layers_of_blocks(layout.skippable_blocks)
    identity.detach()
    bench.base_method = nullmethod
    for record in deleted:  # the plain model is the base: no hooks on either side
        layers = layout.layers_of_blocks(record["settings"]["blocks"])
        record.update(bench.measure_speed(lambda: layers_removed(model, identity.spec, layers)),
                      speed_measured_as="layers deleted, no routers attached")
        log(f"{record['method']} @ {record['target']:.2f} decode with the layers deleted: "
            f"{record['decode_speedup_b1']:.3f}x (B=1), {record['decode_speedup_b8']:.3f}x (B=8)")

    # The update oracle over every skippable layer, and over the layers our per-token policies may skip.
    for name, cheapest in (("oracle-update (runs every layer)", False), ("oracle-update-cheapest (runs every layer)", True)):
        for target in targets:
            layers = candidates_at(identity, removal_order, target) if cheapest else skippable_layers
            extra: dict[str, Any] = {"candidate_blocks": layers} if cheapest else {}
            if not SKIP_IMAGE_POSITIONS:
                extra["image_positions"] = "run every block"
            extra["counted_on"] = counted_on
            before = earlier.get((name, target))
            if before is not None and all(before.get(k) == v for k, v in extra.items()):
                records.append({**before, "quality_from_earlier_run": True})
            else:
                # Calibrated on each workload where its target counts, as our per-token rows are.
                image_ids = () if SKIP_IMAGE_POSITIONS else identity.spec.image_token_ids(model.config)

                def calibrated_oracle(batches, layers=layers, target=target):
                    oracle = UpdateOracle(model, layers, identity.spec.get_layers(model), image_token_ids=image_ids)
                    realised = oracle.calibrate(batches, target * layout.num_layers / len(layers),
                                                counted_on=counted_on or "text")
                    return oracle, realised * len(layers) / layout.num_layers

                oracles = data.per_workload(calibrated_oracle)
                metrics = bench.measure(oracles["captions"][0].skipping, speed=False,
                                        text_method=oracles["text"][0].skipping)
                for workload, prefix in (("captions", ""), ("text", "text_")):
                    metrics[f"{prefix}calibration_skipped_fraction"] = oracles[workload][1]
                records.append(_record(name, target, metrics, **extra))
            log(f"{name} @ {target:.2f}: {records[-1]}")
    store_baselines(cache, key, records)
    return records


BASELINE_CACHE_ENTRIES = 8  # runs with different keys (targets, settings, builds) kept side by side in the cache


def cached_baselines(cache: Path) -> list[dict[str, Any]]:
    """The baseline records stored in `cache`, one `{"key", "records"}` entry per run key, oldest first (a cache
    written before 2026-12-06 held a single run's)."""
    if not cache.is_file():
        return []
    stored = json.loads(cache.read_text())
    return stored.get("entries", [stored] if "key" in stored else [])


def store_baselines(cache: Path, key: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Store a run's baseline `records` in `cache` under `key`: they replace that key's, the other keys' stay (the
    newest `BASELINE_CACHE_ENTRIES` in all)."""
    from vlm_retrofit.files import atomic_write

    entries = [entry for entry in cached_baselines(cache) if entry["key"] != key][-(BASELINE_CACHE_ENTRIES - 1):]
    cache.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"entries": entries + [{"key": key, "records": records}]}, indent=2) + "\n"
    atomic_write(cache, lambda tmp: Path(tmp).write_text(text))


# -- the eval set ---------------------------------------------------------------------------------
def prompt_inputs(processor, images: list) -> dict[str, Any]:
    """Left-padded caption prompts for `images` (one chat each), as model inputs."""
    from .real_vlm import caption_messages

    texts = [processor.apply_chat_template(caption_messages(image), add_generation_prompt=True, tokenize=False)
             for image in images]
    return dict(processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt"))


def _chunks(tokenizer, text: str, length: int, count: int) -> list[torch.Tensor]:
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][:count]


def build_eval_set(processor, manifest: dict[str, Any], args) -> EvalSet:
    """The eval set of `args`' settings: test captions and text, or val with `args.eval_split == "val"`."""
    from vlm_retrofit.batch import model_inputs
    from vlm_retrofit.datamodules import WebDatasetDataModule

    from .data import austen_split, tuxpaint_split
    from .real_vlm import load_image

    tokenizer = getattr(processor, "tokenizer", processor)
    split = getattr(args, "eval_split", "test")
    pairs = tuxpaint_split(split)[: args.caption_samples]
    images = [load_image(path) for path, _ in pairs]
    captions = [prompt_inputs(processor, [image]) for image in images]
    calibration, caption_answers = [], []
    for name in ("captions-val", "austen-val"):
        data = WebDatasetDataModule(processor=args.backbone, val_shards=manifest["shards"][name]["dir"],
                                    train_shards=manifest["shards"][name]["dir"], batch_size=4, num_workers=0,
                                    max_length=384, add_quality_callback=False)
        data.setup("validate")
        batches = [batch for batch, _ in zip(data.val_dataloader(), range(args.calibration_batches))]
        calibration.append([model_inputs(batch) for batch in batches])
        if name == "captions-val":
            caption_answers = [batch["loss_mask"] for batch in batches]
    # Per-token policies are calibrated on each workload as it is measured: the caption val batches for the
    # captions, and for the perplexity raw val text in chunks like the test's. Calibrated on the Austen val
    # *conversations* (chat template, padding) instead, `gate_b3` skipped 4 % of the test text's layer
    # executions at the 10 % target.
    val_text = "\n\n".join(austen_split("val", words=manifest["params"]["words"])) + "\n"
    val_chunks = _chunks(tokenizer, val_text, args.chunk_tokens, 4 * args.calibration_batches)
    text_calibration = [torch.stack(val_chunks[i:i + 4]) for i in range(0, len(val_chunks), 4)]
    text_calibration = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
                        for ids in text_calibration]
    replacement_calibration = []
    for name in ("captions-train", "austen-train"):  # read in order, like the val splits above
        data = WebDatasetDataModule(processor=args.backbone, val_shards=manifest["shards"][name]["dir"],
                                    train_shards=manifest["shards"][name]["dir"], batch_size=4, num_workers=0,
                                    max_length=384, add_quality_callback=False)
        data.setup("validate")
        for batch, _ in zip(data.val_dataloader(), range(args.replacement_batches)):
            inputs = model_inputs(batch)
            replacement_calibration.append((inputs, inputs["attention_mask"].bool()))
    if split == "test":
        text_chunks = _chunks(tokenizer, Path(manifest["austen_test"]["path"]).read_text(), args.chunk_tokens,
                              args.text_chunks)
    else:  # the val text after the chunks the per-token policies calibrate on
        text_chunks = _chunks(tokenizer, val_text, args.chunk_tokens, len(val_chunks) + args.text_chunks)[len(val_chunks):]

    def to(inputs: dict[str, Any]) -> dict[str, Any]:
        return on_device(inputs, args.device)

    caption_batches = len(calibration[0])
    calibration = [to(b) for batches in calibration for b in batches]
    return EvalSet(captions=[to(c) for c in captions], references=[caption for _, caption in pairs],
                   batch8=to(prompt_inputs(processor, (images * 8)[:8])),
                   text_chunks=[c.to(args.device) for c in text_chunks],
                   calibration=calibration,
                   calibration_by_workload={"captions": [{**b, "loss_mask": m.to(args.device)} for b, m in
                                                         zip(calibration[:caption_batches], caption_answers)],
                                            "text": [to(b) for b in text_calibration]},
                   replacement_calibration=[(to(b), m.to(args.device)) for b, m in replacement_calibration])
