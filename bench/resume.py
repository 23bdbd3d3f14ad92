"""A trained variant's measured records kept beside its adapter, so that a stopped benchmark run goes on where it stopped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MEASURED_FILE = "measured.json"
"""Beside a variant's `adapter/` and `train_info.json` under `--runs`: the records the last run measured on it."""


def run_key(bench, targets: list[float], speed_target: float, removal_order: list[int]) -> dict[str, Any]:
    """What every stored measurement of a run depends on (the baselines' and each variant's): the targets, where
    decode speed is timed, the removal order that ranks blocks, and the base's outputs on the eval set."""
    return {"targets": list(targets), "speed_target": speed_target, "removal_order": list(removal_order),
            "base": bench.fingerprint()}


def measured_key(bench, variant_dir: Path, targets: list[float], speed_target: float, removal_order: list[int],
                 settings: dict[str, Any]) -> dict[str, Any]:
    """What a variant's records depend on: the run's `settings` (eval settings, the machine its speed is timed on,
    the policy, how per-token candidates are drawn), the base's outputs on the eval set, the targets, the removal
    order that ranks candidate blocks, how per-token targets are calibrated and counted, and the trained adapter
    itself (its `train_info.json`: a retrained adapter gets another)."""
    train_info = (variant_dir / "train_info.json").read_bytes()
    return {**settings, **run_key(bench, targets, speed_target, removal_order), "tolerance": bench.tolerance,
            "speed_rounds": bench.speed_rounds, "counted_on": bench.counted_on, "unit": bench.unit,
            "allocation": bench.allocation, "candidate_rule": bench.candidate_rule,
            "train_info": hashlib.sha256(train_info).hexdigest()[:16]}


def earlier_measurement(variant_dir: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """`{"records", "overhead"}` an earlier run stored for this variant under `key`, else None (none stored, stored
    under another key, or unreadable: a run stopped while writing leaves the previous file, never half of one)."""
    path = variant_dir / MEASURED_FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != json.loads(json.dumps(key)):
        return None
    return stored


def store_measurement(variant_dir: Path, key: dict[str, Any], records: list[dict[str, Any]],
                      overhead: dict[str, Any] | None) -> None:
    """Keep a variant's `records` (and the router overhead, where it was measured on this variant) under `key`,
    written atomically: the file is the whole measurement or the previous one."""
    from vlm_retrofit.files import atomic_write

    text = json.dumps({"key": key, "records": records, "overhead": overhead}, indent=2) + "\n"
    atomic_write(variant_dir / MEASURED_FILE, lambda tmp: Path(tmp).write_text(text))
