"""Block orderings for static removal on the real VLM, searched once and cached under the runs folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

# What the cached removal searches scored (vlm_retrofit.skipping.calibrate.scored_positions); earlier caches
# scored image positions too and are searched again.
SCORED_ON = "real text positions"


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
