"""One method at a time against the base on the real VLM: the Bench, and the rules every per-token row shares."""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
from typing import Any

import torch

from vlm_retrofit.text_metrics import rouge_l

from .eval_set import EvalSet
from .evaluate import (Method, decode_speed, greedy, nullmethod, paired_speed_ratios, perplexity, speed_ratio,
                       teacher_forced)


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


def operating_point(method: str, target: float, metrics: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One operating point: the results.json keys first, then every other measurement; `extra` overrides."""
    keys = ("compute_saved", "agreement", "ppl_ratio", "rouge_l", "decode_speedup_b1", "decode_speedup_b8")
    merged = {**metrics, **extra}
    return {"method": method, "target": target, **{k: merged.get(k) for k in keys}, **merged}


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
