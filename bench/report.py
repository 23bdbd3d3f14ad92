"""The benchmark report: results.json, RESULTS.md (tables) and pareto.png from one run's records."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any


KEPT_MARKER = ("<!-- The generated report ends here. What follows was written by hand between runs and is kept "
               "when `make bench` writes the report again. -->")
"""Everything after this line of an existing RESULTS.md is carried into the next report written in its folder."""


# -- report -------------------------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 3) -> str:
    return "–" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


def _speed(record: dict[str, Any], batch: str) -> str:
    """A decode-speed ratio with the range of its paired rounds where the run recorded one."""
    value, spread = record.get(f"decode_speedup_{batch}"), record.get(f"decode_speedup_{batch}_range")
    return _fmt(value) + (f" ({spread[0]:.2f}–{spread[1]:.2f})" if value is not None and spread else "")


def _lora_targets(targets: str | list[str] | None) -> str:
    """` on q_proj/v_proj` from a LoRA's target modules: a list, or a regex ending in an alternation."""
    if isinstance(targets, (list, tuple)):
        return " on " + "/".join(targets)
    names = re.search(r"\((?:\?:)?([^()]*)\)\)?$", targets or "")
    return f" on {names.group(1).replace('|', '/')}" if names else (f" on {targets}" if targets else "")


def _recipe(info: dict[str, Any]) -> str:
    """How a variant was trained, from its train_info (older runs recorded less: only what is there)."""
    parts = []
    if info.get("lr") is not None:
        parts.append(f"lr {info['lr']:g}" + (f" ({info['schedule']})" if info.get("schedule") else ""))
    if info.get("precision") or info.get("dtype"):
        parts.append(f"{info.get('precision') or info['dtype']} steps")
    if info.get("precision") and info.get("dtype") not in (None, "float32"):
        parts.append(f"frozen weights in {info['dtype']}")
    if info.get("lora"):
        parts.append(f"LoRA r {info['lora'].get('r', '?')}" + _lora_targets(info["lora"].get("target_modules")))
    if info.get("train_routers") is False:
        parts.append("routers off (identity, untrained): LoRA only")
    elif info.get("query_lr_scale") is not None:
        parts.append(f"queries at {info['query_lr_scale']:g}x lr")
    if info.get("distill_positions"):
        parts.append(f"KL on {info['distill_positions']} positions")
    if info.get("compute_counted_on"):
        parts.append(f"compute target counted on {info['compute_counted_on']}")
    if info.get("max_removed_blocks"):
        parts.append(f"removal schedule k = {info.get('min_removed_blocks', 0)}..{info['max_removed_blocks']}")
    if info.get("replacement_fit_seconds") is not None:
        how = info.get("replacement") or {}
        detail = ""
        if how.get("replacement") == "layer":
            full = ", every span from the full model's stream" if how.get("replacement_inputs") == "full" else ""
            detail = f" ({how['replacement_batches']} batches, {how['replacement_epochs']} passes{full})"
        parts.append(f"{how.get('replacement', 'the')} replacement fitted first{detail}: "
                     f"{info['replacement_fit_seconds'] / 60:.1f} min of the budget")
    if info.get("overrides"):
        parts.append("overridden: " + ", ".join(f"{k}={v}" for k, v in info["overrides"].items()))
    return f"; {', '.join(parts)}" if parts else ""


def _realised(record: dict[str, Any], key: str) -> float:
    """The skipped fraction realised in one workload; records without it (earlier runs) fall back to the
    fraction their greedy captions skipped."""
    for value in (record.get(key), record.get("skipped_fraction"), record.get("compute_saved")):
        if value is not None:
            return value
    return record["target"]


def _skipped(record: dict[str, Any]) -> str:
    keys = ("skipped_fraction", "tf_skipped_fraction", "ppl_skipped_fraction")
    if all(record.get(k) is None for k in keys[1:]):  # an earlier run's record: the greedy figure only
        return _fmt(record.get(keys[0]))
    cells = [_fmt(record.get(k)) for k in keys]
    text = record.get("tf_skipped_text_fraction")
    if text is not None and record.get(keys[1]) is not None and abs(text - record[keys[1]]) > 0.005:
        cells[1] += f" (text {_fmt(text)})"  # image positions skipped otherwise than text (e.g. kept running)
    return " / ".join(cells)


def paired_bootstrap(ours: list[float], other: list[float], resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """Mean of `ours - other` over paired items (the same captions) and its percentile bootstrap interval at `level`
    (the items resampled with replacement `resamples` times): (mean, low, high)."""
    if len(ours) != len(other) or not ours:
        raise ValueError(f"a paired comparison needs two equally long, non-empty lists, got {len(ours)} and "
                         f"{len(other)} items")
    differences = [a - b for a, b in zip(ours, other)]
    count, rng = len(differences), random.Random(seed)
    means = sorted(sum(differences[rng.randrange(count)] for _ in range(count)) / count for _ in range(resamples))
    tail = (1 - level) / 2
    return sum(differences) / count, means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]


def agreement_comparison(records: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: at each target, our row with the lowest perplexity ratio against the other method's row with
    the highest top-1 agreement, paired over the captions (`agreement_per_caption`): at 20 captions one row can lead
    another by a few hundredths by chance. Empty where the records carry no per-caption agreement."""
    def paired(record: dict[str, Any]) -> bool:
        return bool(record.get("agreement_per_caption")) and record["target"] > 0

    rows = []
    for target in sorted({r["target"] for r in records if paired(r)}):
        at = [r for r in records if r["target"] == target and paired(r)]
        ours = [r for r in at if r["method"].startswith("ours")]
        others = [r for r in at if not r["method"].startswith("ours")]
        if not ours or not others:
            continue
        best = min(ours, key=lambda r: r["ppl_ratio"])
        rival = max(others, key=lambda r: r["agreement"])
        if len(best["agreement_per_caption"]) != len(rival["agreement_per_caption"]):
            continue
        mean, low, high = paired_bootstrap(best["agreement_per_caption"], rival["agreement_per_caption"])
        verdict = "ahead" if low > 0 else "behind" if high < 0 else "not told apart"
        rows.append(f"| {target:.2f} | {best['method']} | {best['agreement']:.3f} | {rival['method']} | "
                    f"{rival['agreement']:.3f} | {mean:+.3f} [{low:+.3f}, {high:+.3f}]: {verdict} |")
    if not rows:
        return []
    captions = len(next(r for r in records if paired(r))["agreement_per_caption"])
    return ["", f"Top-1 agreement, ours against the best other row (paired over the same {captions} captions; 95 % "
                "bootstrap interval of the difference: one that holds 0 does not tell the two apart):", "",
            "| target | ours (lowest perplexity ratio) | agreement | other method, highest agreement | agreement | "
            "ours − other [95 % interval] |", "|---|---|---|---|---|---|", *rows]


def write_report(results: dict[str, Any], out_dir: Path) -> None:
    """results.json, RESULTS.md (tables) and pareto.png (layer executions skipped vs quality, one curve per method)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A `-pruned` curve lies on its variant's (same blocks, identity routers: quality within ~1 %); the table has both.
    methods = sorted({r["method"] for r in results["records"] if not r["method"].endswith("-pruned")})
    figure, axes = plt.subplots(1, 2, figsize=(14, 4))
    for index, method in enumerate(methods):
        rows = sorted((r for r in results["records"] if r["method"] == method), key=lambda r: r["target"])
        # Ours solid, baselines dashed; 20 colours, so no two curves share a colour and a style.
        style = dict(marker="o", label=method, color=plt.cm.tab20(index % 20),
                     linestyle="-" if method.startswith("ours") else "--")
        # Each quality against the skipping realised in the workload it was measured on (per-token policies
        # realise another fraction on the Austen text than on the captions).
        axes[0].plot([_realised(r, "ppl_skipped_fraction") for r in rows], [r["ppl_ratio"] for r in rows], **style)
        axes[1].plot([_realised(r, "tf_skipped_fraction") for r in rows], [r["agreement"] for r in rows], **style)
    axes[0].set(xlabel="decoder-layer executions skipped on the held-out text", yscale="log",
                ylabel="held-out perplexity ratio vs base")
    axes[1].set(xlabel="decoder-layer executions skipped on the captions (teacher-forced)",
                ylabel="top-1 agreement with base (teacher-forced)")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))  # beside the plot, not over it
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
    ]
    if results.get("backbone_weights"):
        # A rebuilt projector changes every caption figure (not the text perplexity): name the build measured.
        lines.append(f"* real VLM build: weights {results['backbone_weights']}, base captions "
                     f"{results['base'].get('continuations', '?')} (caption figures compare only within one build)")
    reused = {flag: sorted({r["method"] for r in results["records"] if r.get(flag)})
              for flag in ("measured_in_earlier_run", "quality_from_earlier_run")}
    if reused["measured_in_earlier_run"]:
        lines.append("* measured by an earlier run with the same settings and base outputs, decode speed included "
                     "(`--reuse-measured`): " + ", ".join(f"`{m}`" for m in reused["measured_in_earlier_run"]))
    if reused["quality_from_earlier_run"]:
        lines.append("* quality from an earlier run with the same settings and base outputs, decode speed timed in this "
                     "run (`--reuse-baselines`): " + ", ".join(f"`{m}`" for m in reused["quality_from_earlier_run"]))
    lines += [
        f"* router overhead with skipping off (retrofit ÷ base decode time, batch 1"
        + (f"; routers of {results['router_overhead_measured_on']}" if results.get("router_overhead_measured_on") else "")
        + f"): {_fmt(results['router_overhead'])}",
    ]
    share = results.get("router_time_share")
    if share is not None:
        on_cuda = str(results.get("settings", {}).get("device", "cpu")).startswith("cuda")
        # On CUDA the timers inside the call see the host's kernel launches, not the GPU's work.
        lines.append(f"* routing's share of a routed decode with skipping off (timed inside one generate call, batch 1"
                     f"{', host time: kernel launches, not GPU work' if on_cuda else ''}): "
                     f"{share:.1%}, i.e. overhead {1 / (1 - share):.3f} before hook dispatch and cache effects")
    by_block_size = results.get("router_overhead_by_block_size")
    if by_block_size:
        lines.append("* router overhead with skipping off by block size (routers at init, which cost what trained ones "
                     "do; batch 1): " + "; ".join(
                         f"block size {size} ({entry['routers']} routers): {entry['overhead']:.3f}, routing "
                         f"{entry['time_share']:.1%} of a routed generate call" for size, entry in by_block_size.items()))
    for name, info in results["training"].items():
        took = (f"{info['fit_seconds'] / 60:.1f} of {info['minutes']:g} min" if info.get("fit_seconds")
                else f"{info['minutes']} min")  # older runs recorded the budget only
        lines.append(f"* training `{name}`: {info['steps']} steps in {took}, "
                     f"{info['step_seconds']:.2f} s/step (batch {info['batch_size']}), peak RSS {info['peak_rss_mb']:.0f} MB"
                     + (f", peak CUDA memory {info['peak_cuda_mb']:.0f} MiB" if "peak_cuda_mb" in info else "")
                     + _recipe(info))
    lines += ["", "![layer executions skipped vs quality](pareto.png)", "",
              "| method | target | compute saved (FLOPs, B=1 generate) | saved in decode | "
              "layer executions skipped: greedy captions / teacher-forced captions (their text positions where they differ) / "
              "held-out text | "
              "agreement | KL | ppl ratio | ROUGE-L | ROUGE-L ÷ base | "
              "decode ×base B=1 (one generate call: prefill + 32 new tokens; range of rounds) | B=8 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results["records"], key=lambda r: (r["target"], r["method"])):
        lines.append(" | ".join(["", r["method"], _fmt(r["target"], 2), _fmt(r.get("compute_saved")),
                                 _fmt(r.get("compute_saved_decode")), _skipped(r),
                                 _fmt(r["agreement"]), _fmt(r.get("kl")), _fmt(r["ppl_ratio"]), _fmt(r["rouge_l"]),
                                 _fmt(r.get("rouge_l_ratio")), _speed(r, "b1"), _speed(r, "b8"), ""]).strip())
    lines += agreement_comparison(results["records"])
    lines += ["", results.get("notes", "")]
    report = out_dir / "RESULTS.md"
    # Measurements recorded between runs are not in results.json: a new run's report must not drop them. A report
    # without the marker (written before it existed) is kept whole beside the new one.
    previous = report.read_text() if report.is_file() else ""
    if previous and KEPT_MARKER not in previous:
        report.replace(out_dir / "RESULTS.before.md")
    kept = previous.partition(KEPT_MARKER)[2]
    report.write_text("\n".join(lines).rstrip() + "\n\n" + KEPT_MARKER + (kept or "\n"))
