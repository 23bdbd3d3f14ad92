"""The sweep over methods on the real VLM: each trained variant measured as shipped, then the baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .baselines import measure_baselines
from .eval_set import EvalSet
from .evaluate import nullmethod, routing_share, speed_ratio
from .measuring import (CANDIDATE_FACTOR, SKIP_IMAGE_POSITIONS, Bench, calibrated_per_workload, candidates_at,
                        operating_point, with_replacement)


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
    records.append(operating_point(f"ours-{name}", 0.0, bench.measure(nullmethod, speed=False), compute_saved=0.0))
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
        records.append(operating_point(f"ours-{name}", target, metrics, **extra))
        log(f"ours-{name} @ {target:.2f}: {records[-1]}")
    order, layout, spec, router_config = adapter.removal_order, adapter.layout, adapter.spec, adapter.config
    adapter.detach()
    if policy == "static" and target_model is not model:
        records += measure_pruned(bench, f"ours-{name}-pruned", order, layout, spec, router_config,
                                  targets, speed_target, log, replacement=replacement)
    bench.model = model
    bench.base_method = nullmethod
    return records


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
        records.append(operating_point(name, target, metrics, settings={"blocks": blocks},
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
