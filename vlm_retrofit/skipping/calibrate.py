"""Calibration: per-block skip thresholds that reach a target compute saving on data of the target modality."""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from ..backbones.registry import image_positions, layer_hidden_states, layer_output, unwrap_model
from ..batch import model_inputs
from ..errors import InputError
from ..routing.adapter import RouterAdapter
from .policies import POLICIES, SkipPolicy, StaticPolicy, check_skippable_blocks, recent_source_weight
from .runtime import SkipController


@dataclass
class CalibrationResult:
    """Settings found for one policy and target, and the saving they reach on the calibration data."""

    policy: str
    target_saving: float
    settings: dict[str, Any]
    achieved_saving: float
    skip_rates: list[float] = field(default_factory=list)
    """Per block, the fraction of the counted positions (`counted_on`) that skipped it on the calibration data."""
    counted_on: str = "real positions"
    """Where the saving is counted: "real positions" (no padding), "text positions" (image placeholders kept from
    skipping are left out too) or "answer positions" (the batches' `loss_mask`: what decode steps run)."""
    unit: str = "layers"
    """What the saving counts (`calibrate`'s `unit`): "layers" (layer executions skipped) or "flops" (decoder-layer
    FLOPs saved at decode)."""
    allocation: str = "equal"
    """How a per-token policy's skipping is spread over its candidate blocks (`calibrate`'s `allocation`)."""

    def summary(self) -> str:
        what = "of layer executions skipped" if self.unit == "layers" else "of decoder-layer FLOPs saved"
        return (f"{self.policy}: target {100 * self.target_saving:.1f} % {what}, "
                f"reached {100 * self.achieved_saving:.1f} % on the calibration data ({self.counted_on})")


UNITS = ("layers", "flops")
ALLOCATIONS = ("equal", "shared")


def allocation_problem(policy: str, allocation: str) -> str | None:
    """Why `calibrate` refuses `allocation` for `policy` (None: it takes it); commands check it before loading."""
    if allocation not in ALLOCATIONS:
        return f"allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}"
    if allocation != "equal" and policy in ("static", "random"):
        return (f"allocation {allocation!r} spreads a thresholded policy's skipping (gate, recent_weight); {policy} "
                "has no scores to threshold: leave it at 'equal'")
    return None


def block_savings(adapter: RouterAdapter, unit: str = "layers", *, removed: bool = False) -> dict[int, float]:
    """What a token skipping each block saves, as a share of all the decoder layers it would run.

    `unit="layers"`: the block's share of the layer executions. `"flops"`: its layers' share of the context-free
    decoder FLOPs (`LayerCost.dense`), less what a skip still spends (`SkipController.skipped_layer_cost`): each
    skipped layer's stand-in, if any, and, unless the block is `removed` for the whole context (a static policy),
    its K/V write at decode. Attention over the context is left out: at the benchmark's caption lengths it is a few
    percent of a layer, and a skip saves it too.
    """
    layout = adapter.layout
    if unit not in UNITS:
        raise InputError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    if unit == "layers":
        return {b: len(layout.layers_of_block(b)) / layout.num_layers for b in range(layout.num_blocks)}
    controller = SkipController(adapter)
    total = sum(cost.dense for cost in controller.costs)
    return {b: sum(controller.costs[layer].dense * (1.0 - controller.skipped_layer_cost(layer, writes_cache=not removed))
                   for layer in layout.layers_of_block(b)) / total
            for b in range(layout.num_blocks)}


def _score_fn(policy: str) -> Callable[[int, Any, RouterAdapter], Tensor]:
    if policy == "recent_weight":
        return lambda block, state, adapter: recent_source_weight(state, str(block))
    if policy == "gate":
        return lambda block, state, adapter: adapter.gates[str(block)](state.routed_input, adapter.config.key_norm_eps)
    raise ValueError(policy)


class _ScoreRecorder(SkipPolicy):
    """Records each skippable block's skip score per token (split by modality) and skips nothing. With `positions`
    set (bool [B, T], per batch) the text scores are recorded there only."""

    def __init__(self, score: Callable[[int, Any, RouterAdapter], Tensor]) -> None:
        self.score = score
        self.values: dict[str, dict[int, list[Tensor]]] = {"text": defaultdict(list), "image": defaultdict(list)}
        self.positions: Tensor | None = None

    def next_batch(self, positions: Tensor) -> None:
        self.positions = positions

    def skip_mask(self, block: int, state: Any, adapter: Any) -> None:
        score = self.score(block, state, adapter).detach().float()
        real = state.token_is_real if state.token_is_real is not None else torch.ones_like(score, dtype=torch.bool)
        image = state.token_is_image if state.token_is_image is not None else torch.zeros_like(real)
        # Padding positions are not calibrated on: their routing says nothing about real tokens.
        text = real & ~image if self.positions is None else real & ~image & self.positions.to(real.device)
        self.values["text"][block].append(score[text].cpu())
        if state.token_is_image is not None:
            self.values["image"][block].append(score[real & image].cpu())
        return None


class _CountedSkips(SkipPolicy):
    """`policy` unchanged, counting its skips at chosen positions (`positions`, bool [B, T], set per batch): the
    answer tokens `counted_on="response"` calibrates on, which the runtime's report (real and text positions) does
    not single out."""

    def __init__(self, policy: SkipPolicy, layout: Any) -> None:
        self.policy, self.layout = policy, layout
        self.name, self.reads_gates = policy.name, policy.reads_gates
        self.skip_image_positions = policy.skip_image_positions
        self.positions: Tensor | None = None
        self.tokens = 0
        self.skipped: dict[int, int] = defaultdict(int)

    def next_batch(self, positions: Tensor) -> None:
        self.positions = positions
        self.tokens += int(positions.sum())

    def validate(self, layout: Any, adapter: Any) -> None:
        self.policy.validate(layout, adapter)

    def may_skip(self, layout: Any) -> tuple[int, ...]:
        return self.policy.may_skip(layout)

    def removed_blocks(self) -> frozenset[int]:
        return self.policy.removed_blocks()

    def skip_mask(self, block: int, state: Any, adapter: Any) -> Tensor | None:
        skip = self.policy.skip_mask(block, state, adapter)
        if skip is not None:  # counted positions are answer tokens: never image positions, never padding
            self.skipped[block] += int((skip & self.positions.to(skip.device)).sum())
        return skip

    @property
    def skip_rates(self) -> list[float]:
        return [self.skipped.get(b, 0) / max(1, self.tokens) for b in range(self.layout.num_blocks)]


@torch.no_grad()
def _run(adapter: RouterAdapter, batches: list[dict[str, Any]], policy: SkipPolicy | None,
         positions: list[Tensor] | None = None) -> SkipController:
    """`batches` through the model under `policy`; with `positions` (one bool [B, T] per batch) a policy that
    records or counts at chosen positions (`next_batch`) is told each batch's."""
    controller = SkipController(adapter, policy)
    with controller:
        for i, batch in enumerate(batches):
            if positions is not None:
                policy.next_batch(positions[i])
            adapter.model(**batch)
    return controller


@torch.no_grad()
def block_influence(adapter: RouterAdapter, batches: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """ShortGPT's Block Influence of each block of the *base* model: 1 - cos(in, out), averaged over the real text
    tokens (`scored_positions`, as every removal search scores: no padding, no image placeholders)."""
    model, layout = adapter.model, adapter.layout
    layers = adapter.spec.get_layers(model)
    inputs: dict[int, Tensor] = {}
    current: dict[str, Any] = {}
    sums: dict[int, float] = defaultdict(float)
    counts: dict[int, int] = defaultdict(int)
    handles = []
    for block in range(layout.num_blocks):
        span = layout.layers_of_block(block)

        def pre(module, args, kwargs, block=block):
            inputs[block] = layer_hidden_states(args, kwargs).float()

        def post(module, args, kwargs, output, block=block):
            out = layer_output(output).float()
            influence = 1 - torch.nn.functional.cosine_similarity(inputs.pop(block), out, dim=-1)
            scored, count = current["scored"], current["count"]
            if scored.shape != influence.shape:  # a decoder that expands its input: every position counts
                scored, count = torch.ones_like(influence, dtype=torch.bool), influence.numel()
            sums[block] += float(influence[scored.to(influence.device)].sum())
            counts[block] += count

        handles.append(layers[span[0]].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layers[span[-1]].register_forward_hook(post, with_kwargs=True))
    try:
        with adapter.disabled():
            for batch in batches:
                batch = model_inputs(batch)
                ids = batch.get("input_ids")
                current["scored"] = (scored_positions(adapter, batch, ids.shape) if ids is not None
                                     else torch.ones(0, dtype=torch.bool))
                current["count"] = int(current["scored"].sum())
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return {block: sums[block] / max(counts[block], 1) for block in sums}


@torch.no_grad()
def removal_impact(adapter: RouterAdapter, batches: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Each skippable block's single-block removal impact: mean KL(full || block removed alone) per real text
    token (`scored_positions`: image placeholders are not scored).

    The model runs with the adapter as it is (at init: plain layer dropping). Small models are dense and
    a few blocks are catastrophic to remove (docs/design.md §5): rank blocks from data, not from a fixed list.
    """
    batches, reference = _reference(adapter, batches)
    return {block: _removal_kl(adapter, batches, reference, [block]) for block in adapter.layout.skippable_blocks}


@torch.no_grad()
def greedy_removal_order(adapter: RouterAdapter, batches: Iterable[Mapping[str, Any]], num_blocks: int, *,
                         candidates: Iterable[int] | None = None, start: Iterable[int] = ()
                         ) -> tuple[list[int], list[float]]:
    """The first `num_blocks` blocks greedy *joint* removal picks, and the KL after each pick.

    Each step removes the block that, together with those already removed, costs the least mean
    KL(full || removed) per real text token on `batches`. Single-block impacts ignore how removals interact:
    on SmolLM2-135M the 6 blocks picked this way cost ~10 % less KL than the 6 cheapest ones alone.
    The search runs about `num_blocks * len(candidates)` passes over `batches`; `candidates` (default:
    every skippable block) can narrow it, e.g. to the cheapest blocks by `removal_impact`. `start`: blocks
    already removed (e.g. `best_removal_span`'s), which the order begins with and the search continues from;
    their costs are not searched (NaN), and they count towards `num_blocks`.
    """
    pool = list(adapter.layout.skippable_blocks if candidates is None else candidates)
    unknown = sorted(set(pool) - set(adapter.layout.skippable_blocks))
    if unknown:
        raise InputError(f"candidates {unknown} are not skippable blocks {list(adapter.layout.skippable_blocks)}")
    order = list(start)
    unknown = sorted(set(order) - set(adapter.layout.skippable_blocks))
    if unknown or len(set(order)) != len(order):
        raise ValueError(f"start {order} must be distinct skippable blocks {list(adapter.layout.skippable_blocks)}")
    pool = [b for b in pool if b not in order]
    if not len(order) < num_blocks <= len(order) + len(pool):
        raise ValueError(f"num_blocks must be in [{len(order) + 1}, {len(order) + len(pool)}] (the start blocks plus "
                         f"the candidate blocks), got {num_blocks}")
    batches, reference = _reference(adapter, batches)
    costs: list[float] = [float("nan")] * len(order)
    for _ in range(num_blocks - len(order)):
        cost, block = min((_removal_kl(adapter, batches, reference, order + [b]), b) for b in pool if b not in order)
        order.append(block)
        costs.append(cost)
    return order, costs


@torch.no_grad()
def best_removal_span(adapter: RouterAdapter, batches: Iterable[Mapping[str, Any]], num_blocks: int
                      ) -> tuple[list[int], dict[int, float]]:
    """The run of `num_blocks` adjacent skippable blocks whose removal together costs the least mean
    KL(full || removed) per real text token on `batches`, and that KL for every run (keyed by its first block).

    Greedy joint removal adds one block at a time, so it can miss a set whose members are costly alone but cheap
    together; this scores such sets whole. On SmolLM2-135M the run 13-18 costs less perplexity than the greedy picks
    {13, 14, 16, 17, 18, 26} and heals better. One pass over `batches` per run (~number of blocks passes).
    """
    skippable = list(adapter.layout.skippable_blocks)
    runs = [skippable[i:i + num_blocks] for i in range(len(skippable) - num_blocks + 1)] if num_blocks > 0 else []
    runs = [run for run in runs if run[-1] - run[0] == num_blocks - 1]  # adjacent blocks only
    if not runs:
        raise ValueError(f"num_blocks must be in [1, {len(skippable)}] with that many adjacent skippable blocks "
                         f"({skippable}), got {num_blocks}")
    batches, reference = _reference(adapter, batches)
    costs = {run[0]: _removal_kl(adapter, batches, reference, run) for run in runs}
    first = min(costs, key=costs.__getitem__)
    return list(range(first, first + num_blocks)), costs


def _reference(adapter: RouterAdapter, batches: Iterable[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[Tensor]]:
    """The batches as model inputs and the full model's log-probabilities on them (the adapter as it is)."""
    batches = [model_inputs(b) for b in batches]
    if not batches:
        raise ValueError("removal impact needs at least one batch")
    return batches, [torch.log_softmax(adapter.model(**b).logits.float(), -1) for b in batches]


def scored_positions(adapter: RouterAdapter, batch: Mapping[str, Any], shape: torch.Size) -> Tensor:
    """Real text positions [B, T]: the attention mask without image placeholders. Removals are scored and
    `distill_positions: text` distils on them.

    Nothing reads the predictions at image positions, yet a removal changes them a lot: on the benchmark's VLM
    they held 18 % of the caption batches' positions and up to twice the text positions' KL, enough to rank a
    worse set of layers first.
    """
    ids = batch.get("input_ids")
    device = ids.device if ids is not None else None
    real = batch.get("attention_mask")
    real = real.bool() if real is not None and real.shape == shape else torch.ones(shape, dtype=torch.bool, device=device)
    image = image_positions(ids, torch.tensor(sorted(adapter.spec.image_token_ids(unwrap_model(adapter.model).config)),
                                              dtype=torch.long))
    return real if image is None or image.shape != shape else real & ~image


def _removal_kl(adapter: RouterAdapter, batches: list[dict[str, Any]], reference: list[Tensor], blocks: list[int]) -> float:
    """Mean KL(full || `blocks` removed) per real text token (`scored_positions`)."""
    total = count = 0.0
    with adapter.skipping(StaticPolicy(blocks)):
        for batch, full in zip(batches, reference):
            removed = torch.log_softmax(adapter.model(**batch).logits.float(), -1)
            kl = (full.exp() * (full - removed)).sum(-1)
            scored = scored_positions(adapter, batch, kl.shape).to(kl.device)
            total += float(kl[scored].sum())
            count += int(scored.sum())
    return total / max(count, 1)


def static_prefix(order: list[int], layout, target_saving: float, savings: Mapping[int, float] | None = None
                  ) -> list[int]:
    """The shortest prefix of `order` that removes at least `target_saving` of the layers (or, given `savings`
    per block, e.g. `block_savings(..., removed=True)`, that much of what they count)."""
    chosen, removed = [], 0.0
    for block in order:
        if removed >= target_saving - 1e-9:
            break
        chosen.append(block)
        removed += savings[block] if savings is not None else len(layout.layers_of_block(block)) / layout.num_layers
    return sorted(chosen)


def untrained_removal(adapter: RouterAdapter, blocks: Iterable[int]) -> str | None:
    """Why removing `blocks` for every token runs a model the adapter was not trained for, or None when it was
    (or when its training removed nothing: then no removal is more trained than another). A removal schedule
    (`adapter.removal_range`) trained only the prefixes of `removal_order` of its lengths."""
    if adapter.removal_range is None or adapter.removal_order is None:
        return None
    fewest, most = adapter.removal_range
    order, chosen = list(adapter.removal_order), sorted({int(b) for b in blocks})
    if fewest <= len(chosen) <= most and chosen == sorted(order[:len(chosen)]):
        return None
    layout, fewest = adapter.layout, max(fewest, 1)  # removing nothing is no prune
    low, high = (len(layout.layers_of_blocks(order[:k])) / layout.num_layers for k in (fewest, most))
    counts, targets = (f"{most}", f"{high:.3f}") if fewest == most else (f"{fewest} to {most}", f"{low:.3f} to {high:.3f}")
    return (f"removing blocks {chosen} is not what this adapter was trained for: its training removed the first "
            f"{counts} blocks of its removal order {order[:most]} (a static target of {targets} of the layers)")


def calibrate(adapter: RouterAdapter, batches: Iterable[Mapping[str, Any]], target_saving: float,
              policy: str = "recent_weight", *, per_modality: bool = True, tolerance: float = 0.01,
              max_iterations: int = 16, store: bool = True, order: list[int] | None = None,
              candidates: int | Sequence[int] | None = None, skip_image_positions: bool | None = None,
              counted_on: str | None = None, unit: str = "layers", allocation: str = "equal") -> CalibrationResult:
    """Find settings of `policy` that skip `target_saving` of all decoder-layer executions (or FLOPs) on `batches`.

    The saving is the token-level fraction of layer executions skipped (what a batch-1 decode saves, before
    the kv-only cost), or with `unit="flops"` the fraction of the decoder layers' FLOPs a token saves at decode
    (`block_savings`: a skipped layer's K/V write and stand-in still cost, 6.25 % and 9.4 % of a SmolLM2-135M
    layer). Compare methods at matched FLOPs: a static removal writes no K/V, a per-token skip does.
    `recent_weight` and `gate` get one threshold per candidate block, set with `allocation="equal"` at the same
    quantile of each block's score distribution, so that every candidate block skips the same share of tokens, or
    with `allocation="shared"` at one value for every candidate block (a quantile of their pooled scores), so that
    each block skips the tokens its own scores put below it, as gates trained under a compute penalty learned to
    (on the benchmark's stand-in gates, two seeds on val: level with equal shares, a little better at 20 % and in
    caption KL at 30 %, a little worse at 10 %; bench/HISTORY.md). Image and text positions get their own
    thresholds with `per_modality`; the quantile is found by bisection on runs *with* skipping, since skipping
    shifts the routing of later blocks. `static` removes a prefix of `order` (default: the adapter's trained
    `removal_order`, else the blocks by ascending Block Influence); `random` sets a rate.

    `candidates` (per-token policies): the blocks they may skip. None = every skippable block (spread over them as
    `allocation` says); a count m = the m cheapest blocks by `order` (default: the adapter's
    `removal_order`, else single-block `removal_impact` on `batches`), those its skipping was trained on
    (`skip_candidates`) first; or a list of blocks. None takes the
    adapter's `skip_candidates` when its training was restricted to them. Small models are
    dense: on SmolLM2-135M random per-token skipping of 20 % of layer executions spread over all skippable layers
    raised perplexity x36, spread over the 9 cheapest x1.9.
    `skip_image_positions=False` (per-token policies): visual placeholders run every block, and the target counts
    real text positions only (`SkipReport.skipped_text_layer_fraction`, what decode steps skip). A batch-1 prefill
    saves a block only where every prompt token skips it, so skipping image positions saves almost nothing, yet
    every caption token reads their keys and values. None takes the adapter's training setting
    (`skip_image_positions`, True unless trained with image positions kept).
    `counted_on` (per-token policies): where the target is counted. "real": every real position; "text": real
    text positions (image placeholders left out); "response": the answer tokens (the batches' `loss_mask`, which
    datamodule batches carry): what decode steps run. A caption batch's chat template and prompt hold most of its
    text positions and gates skip them readily: calibrated on text, the benchmark's gates skipped 20 % of the text
    positions' layer executions and 4 % of the answer tokens'. None: "response" where the adapter's compute target
    was counted there in training (`compute_counted_on`), else "real" or "text" as `skip_image_positions` says.
    With `store`, the result is kept in `adapter.calibration` (saved with the adapter) and
    `adapter.skipping(policy, target_saving=...)` uses it: one setting per policy and target, whatever its `unit`.
    """
    if policy not in POLICIES:
        raise InputError(f"unknown skip policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    layout = adapter.layout
    savings = block_savings(adapter, unit, removed=policy == "static")
    if problem := allocation_problem(policy, allocation):
        raise InputError(problem)
    batches = list(batches)
    if not batches:
        raise InputError("calibration needs at least one batch")
    if counted_on is None:
        counted_on = "response" if policy != "static" and adapter.compute_counted_on == "response" else None
    if counted_on not in (None, "real", "text", "response"):
        raise InputError(f"counted_on must be 'real', 'text' or 'response', got {counted_on!r}")
    answers = _answer_positions(batches) if counted_on == "response" and policy != "static" else None
    batches = [model_inputs(b) for b in batches]
    pool = layout.skippable_blocks
    if candidates is None and policy != "static":
        candidates = adapter.skip_candidates  # the blocks its per-token skipping was trained on, if restricted
    if candidates is not None:
        if policy == "static":
            raise InputError("candidates restrict per-token policies; a static removal takes a prefix of `order`")
        pool = candidate_blocks(adapter, batches, candidates, order)
    if skip_image_positions is None:
        skip_image_positions = adapter.skip_image_positions or policy == "static"
    if counted_on in ("real", "text") and policy != "static" and skip_image_positions != (counted_on == "real"):
        raise InputError(f"counted_on={counted_on!r} with skip_image_positions={skip_image_positions}: image positions "
                         "are counted exactly where they may skip ('real' with skip_image_positions=True, 'text' "
                         "without); or count the answer tokens, counted_on='response'")
    if policy == "static" and not skip_image_positions:
        raise InputError("skip_image_positions=False applies to per-token policies; a static removal skips whole "
                         "blocks for every position")
    protect = {} if skip_image_positions else {"skip_image_positions": False}

    def skipped(settings: dict[str, Any]) -> tuple[float, list[float]]:
        """(the saving at the counted positions, each block's skip rate there) under `settings`."""
        if answers is not None:
            counter = _CountedSkips(POLICIES[policy](**settings), layout)
            _run(adapter, batches, counter, answers)
            rates = counter.skip_rates
        else:
            report = _run(adapter, batches, POLICIES[policy](**settings)).report
            rates = report.skip_rates if skip_image_positions else report.text_skip_rates
        return sum(rate * savings[block] for block, rate in enumerate(rates)), rates
    skippable_layers = sum(len(layout.layers_of_block(b)) for b in pool)
    reachable = sum(savings[b] for b in pool)
    if not 0 < target_saving <= reachable + 1e-9:
        measure = "of the layers" if unit == "layers" else "of the decoder-layer FLOPs"
        raise InputError(f"target_saving must be in (0, {reachable:.3f}]: only {skippable_layers} of "
                         f"{layout.num_layers} layers are in the {'candidate' if candidates is not None else 'skippable'}"
                         f" blocks {list(pool)}, {100 * reachable:.1f} % {measure}")

    if policy == "static":
        order = order if order is not None else adapter.removal_order
        if order is None:
            influence = block_influence(adapter, batches)
            order = sorted(layout.skippable_blocks, key=influence.__getitem__)
        settings: dict[str, Any] = {"blocks": static_prefix(list(order), layout, target_saving, savings)}
        problem = untrained_removal(adapter, settings["blocks"])
        if problem:  # measuring it is legitimate (how far the healing carries); shipping it is refused by merge
            warnings.warn(f"static calibration at target {target_saving}: {problem}", stacklevel=2)
    elif policy == "random":
        restricted = {} if candidates is None else {"blocks": list(pool)}
        settings = _bisect(lambda rate: {"rate": rate, **restricted, **protect}, target_saving / reachable,
                           target_saving, tolerance, max_iterations, skipped)
    else:
        recorder = _ScoreRecorder(_score_fn(policy))
        if policy == "gate":
            POLICIES["gate"]().validate(layout, adapter)
        _run(adapter, batches, recorder, answers)
        scores = {modality: {b: torch.cat(v) for b, v in values.items() if b in pool and sum(x.numel() for x in v)}
                  for modality, values in recorder.values.items()}
        if not skip_image_positions:
            scores["image"] = {}  # image positions never skip: their scores set no threshold
        settings = _bisect(lambda rate: {**_settings_at(policy, scores, rate, per_modality, allocation), **protect},
                           target_saving / reachable, target_saving, tolerance, max_iterations, skipped)

    achieved, block_rates = skipped(settings)
    counted = ("answer positions" if answers is not None else "real positions" if skip_image_positions
               else "text positions")
    result = CalibrationResult(policy, float(target_saving), settings, achieved, block_rates, counted, unit, allocation)
    if policy != "static" and abs(result.achieved_saving - target_saving) > tolerance:
        # Tied scores (recent_weight or gates on untrained routers: every token scores the same) give no quantile
        # between "skip none" and "skip all"; too few calibration tokens give coarse steps.
        warnings.warn(f"{result.summary()}: off the target by more than the tolerance {tolerance}. Untrained "
                      "routers or gates score every token alike; more calibration batches give finer steps. "
                      + ("Stored anyway: " if store else "") + "check `achieved_saving` before using it", stacklevel=2)
    if store:
        adapter.calibration.setdefault(policy, {})[f"{float(target_saving):.4f}"] = settings
    return result


def candidate_blocks(adapter: RouterAdapter, batches: list[dict[str, Any]], candidates: int | Sequence[int],
                     order: list[int] | None = None) -> tuple[int, ...]:
    """The blocks a per-token policy may skip (see `calibrate`): `candidates` itself when it lists blocks, else that
    many of the cheapest blocks by `order` (default: the adapter's `removal_order`, else ascending single-block
    `removal_impact` on `batches`), in block order. A count takes the blocks the adapter's per-token skipping was
    trained on (`skip_candidates`) first, cheapest first: the others' gates never learned to skip."""
    layout = adapter.layout
    if isinstance(candidates, (int, float)) and not isinstance(candidates, bool):
        count = int(candidates)
        if count != candidates or not 1 <= count <= len(layout.skippable_blocks):
            raise InputError(f"candidates must be a count in [1, {len(layout.skippable_blocks)}] (the skippable "
                             f"blocks) or a list of blocks, got {candidates!r}")
        if order is None:
            order = adapter.removal_order
        if order is None:
            impact = removal_impact(adapter, batches)
            order = sorted(impact, key=impact.__getitem__)
        ranked = [int(b) for b in order if int(b) in layout.skippable_blocks]
        trained = set(adapter.skip_candidates or ())
        ranked = [b for b in ranked if b in trained] + [b for b in ranked if b not in trained]
        if len(ranked) < count:
            raise InputError(f"the order {list(order)} ranks {len(ranked)} skippable blocks, fewer than the "
                             f"{count} candidates asked for")
        chosen = ranked[:count]
    else:
        chosen = [int(b) for b in candidates]
        if not chosen:
            raise InputError("candidates is an empty list: name at least one skippable block, or give a count")
        if len(set(chosen)) != len(chosen):
            raise InputError(f"candidates {chosen} names a block twice: name each candidate block once")
        check_skippable_blocks("candidates", chosen, layout)
    return tuple(sorted(set(chosen)))


def _settings_at(policy: str, scores: dict[str, dict[int, Tensor]], rate: float, per_modality: bool,
                 allocation: str = "equal") -> dict[str, Any]:
    """Per-block thresholds that would skip a fraction `rate` of each block's tokens (`allocation="equal"`) or of
    all candidate blocks' tokens together at one shared threshold ("shared"), on the no-skip scores."""
    # recent_weight skips high scores; gate skips low run probabilities.
    level = 1.0 - rate if policy == "recent_weight" else rate
    pooled = scores["text"]
    if not per_modality and scores["image"]:
        pooled = {b: torch.cat([scores["text"].get(b, torch.empty(0)), scores["image"].get(b, torch.empty(0))])
                  for b in set(scores["text"]) | set(scores["image"])}

    def thresholds(values: dict[int, Tensor]) -> dict[int, float]:
        edge = float("inf") if policy == "recent_weight" else float("-inf")
        if not 0 < rate < 1:
            return {b: edge if rate <= 0 else -edge for b in values}
        if allocation == "shared" and values:
            shared = float(torch.quantile(torch.cat(list(values.values())), level))
            return {b: shared for b in values}
        return {b: float(torch.quantile(v, level)) for b, v in values.items()}

    key, image_key = ("threshold", "image_threshold") if policy == "gate" else ("thresholds", "image_thresholds")
    settings: dict[str, Any] = {key: thresholds(pooled)}
    if per_modality and scores["image"]:
        settings[image_key] = thresholds(scores["image"])
    return settings


def _answer_positions(batches: list[Mapping[str, Any]]) -> list[Tensor]:
    """Each batch's answer tokens (`loss_mask`, bool [B, T]): where `counted_on="response"` counts."""
    if not all(b.get("loss_mask") is not None and bool(b["loss_mask"].any()) for b in batches):
        raise InputError("counted_on='response' counts the answer tokens: every calibration batch needs a "
                         "`loss_mask` marking some (datamodule batches carry one; pass them whole, not through "
                         "model_inputs), or count text positions with counted_on='text'")
    return [b["loss_mask"].bool() for b in batches]


def _bisect(settings_at, start_rate, target, tolerance, max_iterations, skipped):
    """Bisect the per-block skip rate until runs *with* skipping reach `target` as `skipped(settings)[0]` counts it
    (or the closest seen)."""
    low, high, rate = 0.0, 1.0, min(max(start_rate, 0.0), 1.0)
    best = (float("inf"), settings_at(rate))
    for _ in range(max_iterations):
        settings = settings_at(rate)
        achieved = skipped(settings)[0]
        if abs(achieved - target) < best[0]:
            best = (abs(achieved - target), settings)
        if abs(achieved - target) <= tolerance:
            break
        low, high = (rate, high) if achieved < target else (low, rate)
        rate = (low + high) / 2
    return best[1]
