"""ReSkip: skip decoder blocks per token from the routing signal, with a kv-only cache path and honest accounting."""

from .accounting import LayerCost, SkipReport
from .calibrate import (
    ALLOCATIONS,
    UNITS,
    CalibrationResult,
    allocation_problem,
    best_removal_span,
    block_influence,
    block_savings,
    calibrate,
    candidate_blocks,
    greedy_removal_order,
    removal_impact,
    static_prefix,
    untrained_removal,
)
from .policies import (
    POLICIES,
    GatePolicy,
    PatternPolicy,
    RandomPolicy,
    RecentWeightPolicy,
    SkipPolicy,
    StaticPolicy,
    make_policy,
)
from .consistency import check_skip_consistency
from .runtime import SkipController, kv_only
from .simulation import SkipSimulation

__all__ = [
    "CalibrationResult",
    "ALLOCATIONS",
    "UNITS",
    "allocation_problem",
    "block_savings",
    "best_removal_span",
    "block_influence",
    "calibrate",
    "candidate_blocks",
    "check_skip_consistency",
    "POLICIES",
    "GatePolicy",
    "greedy_removal_order",
    "LayerCost",
    "PatternPolicy",
    "RandomPolicy",
    "RecentWeightPolicy",
    "SkipController",
    "SkipPolicy",
    "SkipReport",
    "SkipSimulation",
    "StaticPolicy",
    "kv_only",
    "make_policy",
    "removal_impact",
    "static_prefix",
    "untrained_removal",
]
