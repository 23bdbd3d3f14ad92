"""bench/sweep.py, measuring.py, baselines.py, orders.py, report.py, resume.py and run.py on a tiny model:
baselines' and variants' records reused only under the same key; report files; the variant selection."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder at the repository root, not an installed package

from bench.report import KEPT_MARKER, agreement_comparison, paired_bootstrap, write_report  # noqa: E402
from bench.run import BASELINES_OUT, ROOT, build_parser, report_dir  # noqa: E402
from bench.variants import VARIANTS, selected_variants  # noqa: E402
from bench.evaluate import nullmethod, perplexity, routing_share, timed_routing  # noqa: E402
from bench.baselines import BASELINE_CACHE_ENTRIES, cached_baselines, measure_baselines, store_baselines  # noqa: E402
from bench.eval_set import EvalSet  # noqa: E402
from bench.measuring import Bench  # noqa: E402
from bench.sweep import measure_pruned, router_overhead_by_block_size  # noqa: E402
from vlm_retrofit import RouterConfig, attach_routers  # noqa: E402
from vlm_retrofit.backbones import resolve  # noqa: E402
from vlm_retrofit.pruning import prune_layers  # noqa: E402
from vlm_retrofit.replacement import fit_replacements, fold_replacements  # noqa: E402
from vlm_retrofit.routing import entry  # noqa: E402
from vlm_retrofit.testing import tiny_inputs, tiny_vlm  # noqa: E402

QUALITY = ("agreement", "kl", "ppl_ratio", "rouge_l", "compute_saved", "skipped_fraction")


def _bench() -> Bench:
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=6)
    prompts = [dict(tiny_inputs(tokenizer, batch=1)), dict(tiny_inputs(tokenizer, batch=2))]
    prompts = [{k: v[:1] for k, v in p.items()} for p in prompts]
    generator = torch.Generator().manual_seed(0)
    chunks = [torch.randint(3, len(tokenizer), (24,), generator=generator) for _ in range(2)]
    data = EvalSet(captions=prompts, references=["a red square", "a blue circle"],
                   batch8=dict(tiny_inputs(tokenizer, batch=2)), text_chunks=chunks,
                   calibration=[dict(tiny_inputs(tokenizer, batch=2))])
    bench = Bench(model, tokenizer, data, new_tokens=4)
    bench.measure_base()
    return bench


def _run(bench: Bench, cache: Path, key: dict, reuse: bool, joint=(3, 4, 2)) -> list[dict]:
    return measure_baselines(bench, [0.25], 0.25, [2, 3, 1, 4], list(joint), lambda message: None, cache=cache,
                             key=key, reuse=reuse, span_order=[4, 3, 2])


def test_the_base_record_names_its_captions_as_the_baseline_key_does():
    bench = _bench()
    base = bench.measure_base()  # what results.json records as "base"
    assert set(base) == {"ppl", "rouge_l", "speed_b1", "speed_b8", "continuations"}
    assert base["continuations"] == bench.fingerprint()["continuations"] and len(base["continuations"]) == 16


def test_baselines_are_reused_only_under_the_same_key_and_their_speed_is_measured_again(tmp_path):
    bench = _bench()
    cache = tmp_path / "baselines.json"
    first = _run(bench, cache, {"caption_samples": 2}, reuse=False)
    assert {r["method"] for r in first} == {"static-block-influence", "static-greedy-impact", "static-greedy-joint",
                                            "static-span", "random", "oracle-update (runs every layer)",
                                            "random-cheapest", "oracle-update-cheapest (runs every layer)"}
    # Restricted to the cheapest blocks by the removal order: 1.5 x the 2 blocks a static removal takes, of 4.
    cheapest = next(r for r in first if r["method"] == "random-cheapest")
    assert cheapest["settings"]["blocks"] == [1, 2, 3]
    assert next(r for r in first if r["method"].startswith("oracle-update-cheapest"))["candidate_blocks"] == [1, 2, 3]
    assert [entry["records"] for entry in cached_baselines(cache)] == [json.loads(json.dumps(first))]
    greedy = next(r for r in first if r["method"] == "static-greedy-impact")
    assert greedy["settings"] == {"blocks": [2, 3]}  # the order's prefix removing >= 25 % of 6 layers
    assert greedy["speed_measured_as"] == "layers deleted, no routers attached" and greedy["decode_speedup_b1"] > 0
    assert next(r for r in first if r["method"] == "static-greedy-joint")["settings"] == {"blocks": [3, 4]}
    assert next(r for r in first if r["method"] == "static-span")["settings"] == {"blocks": [3, 4]}

    # Poison the stored quality: a reused record must come from the file, not from a fresh measurement.
    stored = json.loads(cache.read_text())
    for record in stored["entries"][0]["records"]:
        record["agreement"] = -1.0
    cache.write_text(json.dumps(stored))
    reused = _run(bench, cache, {"caption_samples": 2}, reuse=True)
    assert all(r["quality_from_earlier_run"] and r["agreement"] == -1.0 for r in reused)
    for record in reused:  # the speed target's decode speed is measured in this run, except the oracle's
        measured = not record["method"].startswith("oracle-update")
        assert (record["decode_speedup_b1"] is not None) == measured
        assert record["decode_speedup_b1"] is None or record["decode_speedup_b1"] > 0

    # Another joint order: only the static records whose blocks it changes are measured anew.
    rejoined = _run(bench, cache, {"caption_samples": 2}, reuse=True, joint=(2, 4, 3))
    assert [r["method"] for r in rejoined if not r.get("quality_from_earlier_run")] == ["static-greedy-joint"]
    assert next(r for r in rejoined if r["method"] == "static-greedy-joint")["agreement"] != -1.0

    other = _run(bench, cache, {"caption_samples": 3}, reuse=True)  # other settings: everything measured anew
    assert not any(r.get("quality_from_earlier_run") for r in other)
    for new, old in zip(other, first):
        assert new["method"] == old["method"]
        assert all(new[k] == old[k] for k in QUALITY if k in old)  # quality is deterministic
    # ... and stored beside the first settings' records, which a later run under those settings still reuses.
    assert [entry["key"]["caption_samples"] for entry in cached_baselines(cache)] == [2, 3]
    again = _run(bench, cache, {"caption_samples": 2}, reuse=True, joint=(2, 4, 3))  # as the first key last ran
    assert all(r.get("quality_from_earlier_run") for r in again)


def test_random_and_oracle_baselines_are_calibrated_per_workload_where_ours_are_counted(tmp_path):
    bench = _bench()
    answers = torch.zeros_like(bench.data.calibration[0]["attention_mask"])
    answers[:, -4:] = 1
    text = [{"input_ids": torch.stack(bench.data.text_chunks), "attention_mask": torch.ones(2, 24, dtype=torch.long)}]
    text[0]["loss_mask"] = torch.ones(2, 24, dtype=torch.long)
    bench.data.calibration_by_workload = {"captions": [{**bench.data.calibration[0], "loss_mask": answers}],
                                          "text": text}
    cache = tmp_path / "baselines.json"
    first = _run(bench, cache, {"caption_samples": 2}, reuse=False)
    per_token = [r for r in first if r["method"].startswith(("random", "oracle"))]
    assert len(per_token) == 4 and all(r["counted_on"] == "response" for r in per_token)
    assert not any("counted_on" in r for r in first if r["method"].startswith("static"))
    for record in per_token:
        if record["method"].startswith("random"):  # one setting per workload, each realising the target there
            assert record["text_settings"]["rate"] != record["settings"]["rate"]
        else:
            assert record["calibration_skipped_fraction"] != record["text_calibration_skipped_fraction"]
    # Counted on other positions, the per-token baselines are measured anew; the static removals are reused.
    bench.counted_on = "text"
    again = _run(bench, cache, {"caption_samples": 2}, reuse=True)
    assert {r["method"] for r in again if not r.get("quality_from_earlier_run")} == {r["method"] for r in per_token}
    assert all(r["counted_on"] == "text" for r in again if r["method"].startswith(("random", "oracle")))


def test_the_baseline_cache_keeps_the_newest_keys_and_reads_a_one_run_cache(tmp_path):
    cache = tmp_path / "baselines.json"
    assert cached_baselines(cache) == []
    one_run = {"key": {"targets": [0.1]}, "records": [{"method": "random", "target": 0.1}]}
    cache.write_text(json.dumps(one_run))  # as written before entries
    assert cached_baselines(cache) == [one_run]
    for target in (0.2, 0.1, *(0.3 + i / 100 for i in range(BASELINE_CACHE_ENTRIES))):
        store_baselines(cache, {"targets": [target]}, [{"method": "random", "target": target}])
    kept = [entry["key"]["targets"][0] for entry in cached_baselines(cache)]
    assert kept == [0.3 + i / 100 for i in range(BASELINE_CACHE_ENTRIES)]  # the oldest keys went first
    store_baselines(cache, {"targets": [0.3]}, [])  # a key stored again replaces its records, moved last
    assert [entry["key"]["targets"][0] for entry in cached_baselines(cache)][-2:] == [0.37, 0.3]
    assert cached_baselines(cache)[-1]["records"] == [] and len(cached_baselines(cache)) == BASELINE_CACHE_ENTRIES


def test_every_workload_records_the_skipping_it_realised():
    from bench.baselines import OracleCount, UpdateOracle

    bench = _bench()
    identity = attach_routers(bench.model, RouterConfig(block_size=1))
    static = bench.measure(lambda: identity.skipping("static", blocks=[2, 3]), speed=False)
    for key in ("skipped_fraction", "tf_skipped_fraction", "ppl_skipped_fraction"):
        assert static[key] == pytest.approx(2 / 6), key  # a static removal skips its share on every workload
    base = bench.measure(nullmethod, speed=False)
    assert "ppl_skipped_fraction" not in base  # the base yields no count
    # The base agrees with its own continuations on every caption: the per-caption values a paired comparison takes.
    assert base["agreement_per_caption"] == [1.0] * len(bench.data.captions) and base["agreement"] == 1.0
    assert static["agreement"] == pytest.approx(sum(static["agreement_per_caption"]) / len(bench.data.captions),
                                                abs=1e-4)
    identity.detach()

    # A per-token rule realises its own fraction on each workload: each counts that workload's passes only.
    oracle = UpdateOracle(bench.model, range(1, 5), resolve(bench.model).get_layers(bench.model))
    oracle.calibrate(bench.data.calibration, 0.5)
    metrics = bench.measure(oracle.skipping, speed=False)
    counts = []
    with torch.no_grad():
        for ids in bench.data.text_chunks:
            with oracle.skipping() as count:
                bench.model(input_ids=ids[None], use_cache=False)
            counts.append(count)
    assert metrics["ppl_skipped_fraction"] == pytest.approx(OracleCount.merged(counts).skipped_layer_fraction)
    assert 0 < metrics["ppl_skipped_fraction"] < 4 / 6
    assert metrics["skipped_fraction"] != metrics["ppl_skipped_fraction"]  # not one count over every pass


def test_per_token_policies_are_calibrated_and_measured_per_workload():
    from bench.measuring import calibrated_per_workload

    bench = _bench()
    adapter = attach_routers(bench.model, RouterConfig(block_size=1))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for router in adapter.routers.values():
            router.query.copy_(0.5 * torch.randn(router.query.shape, generator=generator))
    text = [{"input_ids": torch.stack(bench.data.text_chunks), "attention_mask": torch.ones(2, 24, dtype=torch.long)}]
    bench.data.calibration_by_workload = {"captions": bench.data.calibration, "text": text}
    settings = calibrated_per_workload(adapter, bench.data, 0.3, "recent_weight", tolerance=0.02)
    assert settings["captions"] != settings["text"]
    # Counted on the answer tokens (the workloads' loss_mask) the captions' settings are another calibration.
    answers = [{**b, "loss_mask": b["attention_mask"].bool() & (torch.arange(b["input_ids"].shape[1]) >= 4)}
               for b in bench.data.calibration]
    counted = calibrated_per_workload(adapter, EvalSet(**{**vars(bench.data), "calibration_by_workload": {
        "captions": answers, "text": [{**b, "loss_mask": b["attention_mask"]} for b in text]}}), 0.3, "recent_weight",
        tolerance=0.02, counted_on="response")
    assert counted["captions"] != settings["captions"] and counted["text"] == settings["text"]
    # The text workload's settings realise the target on the text; measured under them, so does the perplexity.
    methods = {w: (lambda s=s: adapter.skipping("recent_weight", **s)) for w, s in settings.items()}
    metrics = bench.measure(methods["captions"], text_method=methods["text"], speed=False)
    assert metrics["ppl_skipped_fraction"] == pytest.approx(0.3, abs=0.02)
    pooled = bench.measure(methods["captions"], speed=False)
    assert pooled["ppl_skipped_fraction"] != metrics["ppl_skipped_fraction"]
    assert pooled["skipped_fraction"] == metrics["skipped_fraction"]  # the captions ran the same settings
    # A static removal does not depend on the batches; without workloads both calibrate on the pooled batches.
    static = calibrated_per_workload(adapter, bench.data, 0.3, "static", tolerance=0.02)
    assert static["captions"] == static["text"] == {"blocks": static["text"]["blocks"]}
    bench.data.calibration_by_workload = {}
    pooled_settings = calibrated_per_workload(adapter, bench.data, 0.3, "recent_weight", tolerance=0.02)
    assert pooled_settings["captions"] == pooled_settings["text"] == settings["captions"]


def test_workloads_sharing_their_batches_are_calibrated_once():
    data = _bench().data
    calls = []
    calibrate_on = lambda batches: calls.append(batches) or len(calls)  # noqa: E731
    assert data.per_workload(calibrate_on) == {"captions": 1, "text": 1} and calls == [data.calibration]
    data.calibration_by_workload = {"captions": data.calibration, "text": data.calibration[:1]}
    assert data.per_workload(calibrate_on) == {"captions": 2, "text": 3}


def _pruned_ppl(bench, layers, transforms=None):
    import copy

    pruned = copy.deepcopy(bench.model)
    spec = resolve(pruned)
    if transforms:
        fold_replacements(pruned, spec, transforms)
    prune_layers(pruned, spec, layers)
    return perplexity(pruned, bench.data.text_chunks, nullmethod) / bench.base["ppl"]


def test_replacement_baseline_measures_the_folded_pruned_model(tmp_path):
    bench = _bench()
    batches = bench.data.calibration + [dict(tiny_inputs(bench.processor, batch=3))]
    bench.data.replacement_calibration = [(b, b["attention_mask"].bool()) for b in batches]
    records = _run(bench, tmp_path / "baselines.json", {}, reuse=False)
    replaced = next(r for r in records if r["method"] == "static-greedy-joint-replaced")
    plain = next(r for r in records if r["method"] == "static-greedy-joint")
    assert replaced["settings"] == {"blocks": [3, 4], "replacement_batches": 2} and plain["settings"]["blocks"] == [3, 4]
    assert replaced["speed_measured_as"] == plain["speed_measured_as"] and replaced["decode_speedup_b1"] > 0
    assert replaced["compute_saved"] == plain["compute_saved"]
    transforms = fit_replacements(bench.model, resolve(bench.model), [3, 4], bench.data.replacement_calibration)
    assert abs(replaced["ppl_ratio"] - _pruned_ppl(bench, [3, 4], transforms)) < 1e-4
    assert abs(plain["ppl_ratio"] - _pruned_ppl(bench, [3, 4])) < 1e-4
    assert abs(replaced["ppl_ratio"] - plain["ppl_ratio"]) > 1e-4
    again = _run(bench, tmp_path / "baselines.json", {}, reuse=True)
    assert next(r for r in again if r["method"] == "static-greedy-joint-replaced")["quality_from_earlier_run"]


def test_pruned_release_records_measure_what_the_pruned_model_computes(tmp_path):
    bench = _bench()
    adapter = attach_routers(bench.model, RouterConfig(block_size=1))
    layout, spec, config = adapter.layout, adapter.spec, adapter.config
    adapter.detach()
    records = measure_pruned(bench, "ours-x-pruned", [2, 3, 1, 4], layout, spec, config, [0.25, 0.5], 0.25,
                             lambda message: None)
    assert [(r["target"], r["settings"]["blocks"]) for r in records] == [(0.25, [2, 3]), (0.5, [1, 2, 3])]
    assert records[0]["decode_speedup_b1"] > 0 and records[1]["decode_speedup_b1"] is None
    assert "pruned release" in records[0]["speed_measured_as"]
    assert not any(entry.has_entry(layer) for layer in spec.get_layers(bench.model))  # identity routers detached
    assert abs(records[0]["ppl_ratio"] - _pruned_ppl(bench, [2, 3])) < 1e-4
    assert "replacement" not in records[0]

    # A variant's linear replacement is folded in where its layers are the ones removed, and only there.
    transforms = {1: torch.eye(64) + 0.05 * torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}
    weights = {k: v.clone() for k, v in bench.model.state_dict().items()}
    replaced = measure_pruned(bench, "ours-x-pruned", [2, 3, 1, 4], layout, spec, config, [0.25, 0.5], 0.25,
                              lambda message: None, replacement=(transforms, [2, 3]))
    assert [r.get("replacement", False) for r in replaced] == [True, False]
    assert abs(replaced[0]["ppl_ratio"] - _pruned_ppl(bench, [2, 3], transforms)) < 1e-4
    assert replaced[1]["ppl_ratio"] == records[1]["ppl_ratio"]
    assert all(torch.equal(v, weights[k]) for k, v in bench.model.state_dict().items())  # unfolded afterwards


def test_report_writes_json_markdown_and_plot(tmp_path):
    record = {"method": "static-greedy-impact", "target": 0.2, "compute_saved": 0.19, "agreement": 0.5,
              "ppl_ratio": 2.0, "rouge_l": 0.3, "decode_speedup_b1": 1.1, "decode_speedup_b1_range": [1.04, 1.16],
              "decode_speedup_b8": None, "kl": 0.4}
    kept = {**record, "method": "ours-gate", "skipped_fraction": 0.21, "tf_skipped_fraction": 0.1,
            "tf_skipped_text_fraction": 0.2, "ppl_skipped_fraction": 0.19}  # image positions kept from skipping
    results = {"date": "2026-01-01", "machine": "test", "backbone": "tiny", "router_overhead": 1.05,
               "router_time_share": 0.04, "backbone_weights": "0123456789abcdef",
               "router_overhead_by_block_size": {"1": {"routers": 30, "overhead": 1.031, "time_share": 0.027},
                                                 "2": {"routers": 15, "overhead": 1.012, "time_share": 0.013}},
               "base": {"ppl": 50.0, "rouge_l": 0.35, "speed_b1": 10.0, "speed_b8": 40.0, "continuations": "feed"},
               "training": {"routed": {"steps": 3, "minutes": 1.0, "step_seconds": 2.0, "batch_size": 4,
                                       "peak_rss_mb": 100.0, "lr": 2e-3, "query_lr_scale": 0.04,
                                       "max_removed_blocks": 9, "min_removed_blocks": 6},
                            "plain": {"steps": 3, "minutes": 1.0, "step_seconds": 2.0, "batch_size": 4,
                                      "peak_rss_mb": 100.0, "lr": 2e-3, "schedule": "cosine to 0.1x over 3 steps",
                                      "fit_seconds": 48.0, "lora": {"r": 16, "target_modules": ["q_proj", "down_proj"]},
                                      "query_lr_scale": 0.04, "train_routers": False},
                            "gated": {"steps": 3, "minutes": 1.0, "step_seconds": 2.0, "batch_size": 4,
                                      "peak_rss_mb": 100.0, "query_lr_scale": 0.04, "train_routers": True,
                                      "lora": {"r": 8, "target_modules": r".*language_model.*\.(q_proj|v_proj)"}},
                            "layer": {"steps": 3, "minutes": 1.0, "step_seconds": 2.0, "batch_size": 4,
                                      "peak_rss_mb": 100.0, "replacement_fit_seconds": 24.0,
                                      "replacement": {"replacement": "layer", "replacement_batches": 192,
                                                      "replacement_epochs": 8, "replacement_lr": 2e-3,
                                                      "replacement_inputs": "full"},
                                      "overrides": {"replacement_epochs": 8}}},
               "records": [record, kept]}
    out = tmp_path / "new" / "folder"  # a folder that does not exist yet is created, not a lost report
    write_report(results, out)
    assert json.loads((out / "results.json").read_text())["records"] == [record, kept]
    table = (out / "RESULTS.md").read_text()
    assert "earlier run" not in table
    # Records taken from earlier runs are named as such above the table.
    write_report({**results, "records": [{**record, "quality_from_earlier_run": True},
                                         {**kept, "measured_in_earlier_run": True}]}, tmp_path / "reused")
    reused = (tmp_path / "reused" / "RESULTS.md").read_text()
    assert "decode speed included (`--reuse-measured`): `ours-gate`" in reused
    assert "decode speed timed in this run (`--reuse-baselines`): `static-greedy-impact`" in reused
    assert "| static-greedy-impact | 0.20 | 0.190 |" in table and "router overhead" in table
    assert "| 1.100 (1.04–1.16) | – |" in table  # the median of the paired rounds with their range
    assert "4.0%, i.e. overhead 1.042" in table
    assert "block size 2 (15 routers): 1.012, routing 1.3% of a routed generate call" in table
    assert "real VLM build: weights 0123456789abcdef, base captions feed" in table  # which build's captions these are
    assert "| 0.210 / 0.100 (text 0.200) / 0.190 |" in table  # the caption passes' text positions beside all
    assert "lr 0.002, queries at 0.04x lr, removal schedule k = 6..9" in table
    assert ("lr 0.002 (cosine to 0.1x over 3 steps), LoRA r 16 on q_proj/down_proj, routers off (identity, "
            "untrained): LoRA only") in table
    assert "`gated`: 3 steps in 1.0 min, 2.00 s/step (batch 4), peak RSS 100 MB; LoRA r 8 on q_proj/v_proj, queries" in table
    assert "`plain`: 3 steps in 0.8 of 1 min" in table and "`routed`: 3 steps in 1.0 min" in table
    assert ("layer replacement fitted first (192 batches, 8 passes, every span from the full model's stream): "
            "0.4 min of the budget, "
            "overridden: replacement_epochs=8") in table
    assert (out / "pareto.png").stat().st_size > 0
    # Measurements written by hand below the marker survive the next run's report; the analysis above it is the run's.
    by_hand = "\n\n## Measured between runs\n\nA probe.\n"
    (out / "RESULTS.md").write_text(table.rstrip("\n") + by_hand)
    write_report({**results, "date": "2026-02-02", "notes": "The next run."}, out)
    again = (out / "RESULTS.md").read_text()
    assert again.endswith(KEPT_MARKER + by_hand) and again.count(KEPT_MARKER) == 1
    assert "Run 2026-02-02" in again and "The next run." in again
    (out / "RESULTS.md").write_text("# An older report, without the marker\n")
    write_report(results, out)
    assert (out / "RESULTS.before.md").read_text() == "# An older report, without the marker\n"  # kept whole


def test_paired_bootstrap_brackets_the_mean_difference_and_narrows_with_more_pairs():
    assert paired_bootstrap([0.9, 0.8, 0.7], [0.9, 0.8, 0.7]) == (0.0, 0.0, 0.0)
    assert paired_bootstrap([1.0] * 4, [0.5] * 4) == (0.5, 0.5, 0.5)  # every resample sees the same difference
    few = [0.1, -0.1] * 5
    mean, low, high = paired_bootstrap([0.8 + d for d in few], [0.8] * 10)
    assert mean == pytest.approx(0.0) and low < 0 < high
    _, wide_low, wide_high = paired_bootstrap([0.8 + d for d in few * 10], [0.8] * 100)
    assert low < wide_low < 0 < wide_high < high  # ten times the captions: a narrower interval
    assert paired_bootstrap([0.5, 0.6], [0.6, 0.5], seed=3) == paired_bootstrap([0.5, 0.6], [0.6, 0.5], seed=3)
    with pytest.raises(ValueError, match="equally long"):
        paired_bootstrap([0.5], [0.5, 0.6])


def test_agreement_comparison_pairs_our_best_row_with_the_most_agreeing_other_row():
    def row(method, target, ppl, per_caption):
        return {"method": method, "target": target, "ppl_ratio": ppl, "agreement_per_caption": per_caption,
                "agreement": sum(per_caption) / len(per_caption)}

    records = [
        row("ours-healed", 0.1, 1.0, [0.9, 1.0, 0.8, 1.0]),         # lowest perplexity ratio of ours at 0.1
        row("ours-gate", 0.1, 1.5, [1.0, 1.0, 1.0, 1.0]),           # agrees more, but is not our best row
        row("random", 0.1, 3.0, [0.5, 0.6, 0.4, 0.5]),
        row("static-span", 0.1, 1.3, [0.6, 0.6, 0.7, 0.6]),          # the other row that agrees most
        row("ours-healed", 0.2, 1.1, [0.5, 0.6, 0.4, 0.5]),
        row("static-span", 0.2, 1.6, [0.9, 0.9, 0.8, 0.9]),
        row("ours-healed", 0.3, 1.2, [0.8, 0.6, 0.8, 0.6]),
        row("random", 0.3, 5.0, [0.6, 0.8, 0.6, 0.8]),
        row("ours-healed", 0.0, 1.0, [1.0, 1.0, 1.0, 1.0]),          # nothing skipped: not a comparison
        {"method": "static-old", "target": 0.4, "ppl_ratio": 2.0, "agreement": 0.9},  # an older record: no pairs
    ]
    lines = agreement_comparison(records)
    assert "same 4 captions" in lines[1]
    rows = [line for line in lines if line.startswith("| 0.")]
    assert [line.split(" | ")[:2] + [line.split(" | ")[3]] for line in rows] == [
        ["| 0.10", "ours-healed", "static-span"], ["| 0.20", "ours-healed", "static-span"],
        ["| 0.30", "ours-healed", "random"]]
    assert rows[0].endswith(": ahead |") and "+0.300" in rows[0]
    assert rows[1].endswith(": behind |") and "-0.375" in rows[1]
    assert rows[2].endswith(": not told apart |") and "+0.000" in rows[2]
    assert agreement_comparison([records[-1]]) == []  # records without per-caption agreement: no section


def test_the_recorded_analysis_is_the_one_results_json_holds():
    # `make bench` writes RESULTS.md from results.json: an analysis edited in RESULTS.md alone would be lost by it.
    recorded = (ROOT / "RESULTS.md").read_text()
    notes = json.loads((ROOT / "results.json").read_text())["notes"]
    assert notes and notes in recorded.partition(KEPT_MARKER)[0]


def test_a_baselines_only_run_never_writes_over_the_recorded_report(tmp_path):
    parser = build_parser()
    assert report_dir(parser.parse_args([])) == ROOT  # make bench: the recorded table
    baselines_only = parser.parse_args(["--variants"])
    assert baselines_only.variants == [] and report_dir(baselines_only) == BASELINES_OUT != ROOT
    assert report_dir(parser.parse_args(["--variants", "--out", str(tmp_path)])) == tmp_path


def test_train_steps_override_only_the_fixed_step_variants():
    names = ["lora_mlp_joint_plain", "routed_static_lora_mlp_joint_cosine", "gate"]
    registered = [VARIANTS[n].steps for n in names]
    assert registered[0] and registered[1] and registered[2] is None
    assert [v.steps for v in selected_variants(names)] == registered
    plain, cosine, gate = selected_variants(names, train_steps=600)
    assert plain.steps == cosine.steps == 600 and gate.steps is None  # time-budgeted variants stay so
    assert [VARIANTS[n].steps for n in names] == registered  # the registry is not modified


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_builds_the_module_it_trains(name):
    """A variant's recipe (router, LoRA targets, skip candidates, replacement settings, its removal) is accepted by
    `RetrofitModule` as `train_variant` passes it: a bad field or a LoRA that matches no layer would otherwise
    surface only after a bench run's minutes of searches."""
    from bench.training import training_arguments
    from bench.variants import own_span_key, removal_settings
    from vlm_retrofit.training import RetrofitModule

    variant = VARIANTS[name]
    orders = {kind: [9, 8, 10, 11, 7, 12, 3] for kind in ("impact", "joint", "span", own_span_key(6))}
    removal = removal_settings(variant, orders, 6, 4, 2, {0.1: 2, 0.2: 4, 0.3: 6})
    arguments = training_arguments(variant, removal, decay_over="budget")
    module = RetrofitModule(backbone="tiny:llava", backbone_kwargs={"num_hidden_layers": 20}, router=variant.router,
                            **arguments)
    assert module.adapter.config.block_size == variant.router["block_size"]
    lora = variant.module.get("lora")
    adapted = [n for n, p in module.model.named_parameters() if "lora_" in n and p.requires_grad]
    assert bool(adapted) == bool(lora)  # the LoRA's target pattern matches the family's language-model layers
    if lora:
        assert all("language_model" in n for n in adapted)
    assert module.hparams.skip_candidates == variant.module.get("skip_candidates")
    assert module.hparams.max_removed_blocks == removal.get("max_removed_blocks", 0)


def test_budget_decay_runs_the_schedule_over_the_wall_clock():
    from types import SimpleNamespace

    from bench.training import BudgetDecay

    now = [0.0]
    decay = BudgetDecay(100.0, clock=lambda: now[0])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    module = SimpleNamespace(hparams=SimpleNamespace(scheduler="cosine", warmup_steps=4, min_lr_ratio=0.1))
    decay.on_train_start(trainer, module)
    factor = scheduler.lr_lambdas[0]
    assert factor(0) == 0.25 and factor(3) == 1.0  # warmup in steps
    now[0] = 50.0
    assert factor(3) == pytest.approx(0.55) and factor(400) == pytest.approx(0.55)  # half the budget: whatever the step
    now[0] = 100.0
    assert factor(10) == pytest.approx(0.1)
    now[0] = 500.0  # past the budget (the time cap ends the run): the floor
    assert factor(10) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="budget"):
        BudgetDecay(0)


def test_budget_decay_spends_the_fits_preparation_from_the_budget_and_ends_the_run():
    from types import SimpleNamespace

    from bench.training import BudgetDecay

    now = [0.0]
    decay = BudgetDecay(100.0, clock=lambda: now[0])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)], should_stop=False)
    module = SimpleNamespace(hparams=SimpleNamespace(scheduler="cosine", warmup_steps=0, min_lr_ratio=0.1))
    decay.on_fit_start(trainer, module)
    now[0] = 30.0  # e.g. a layer replacement fitted before the first step
    decay.on_train_start(trainer, module)
    now[0] = 50.0
    assert scheduler.lr_lambdas[0](0) == pytest.approx(0.55)  # half the budget since the fit started
    decay.on_train_batch_end(trainer)
    assert not trainer.should_stop
    now[0] = 100.0
    decay.on_train_batch_end(trainer)
    assert trainer.should_stop


def test_budget_decay_ends_a_training_run_at_the_floor():
    import lightning.pytorch as pl

    from bench.training import BudgetDecay
    from vlm_retrofit.training import FixedBatchDataModule, RetrofitModule

    module = RetrofitModule(backbone="tiny:llama", lr=1e-2, warmup_steps=1, max_drop_rate=0.5)
    data = FixedBatchDataModule(processor="tiny:llama", num_batches=4, val_batches=0, batch_size=2, seed=0)
    trainer = pl.Trainer(max_time={"seconds": 4}, max_steps=100000, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[BudgetDecay(2.0)])
    trainer.fit(module, data)
    assert trainer.global_step > 5  # the time cap ended it, not a step count
    # Decayed to a tenth within the budget (the last step's rate was read a moment before the clock ran out).
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3, rel=1e-3)


def test_training_arguments_scale_the_learning_rate_and_keep_the_recipe():
    from bench.training import training_arguments

    removal = {"removal_order": [2, 3, 1], "max_removed_blocks": 2, "min_removed_blocks": 2}
    plain = training_arguments(VARIANTS["lora_mlp_span"], removal)
    scaled = training_arguments(VARIANTS["lora_mlp_span"], removal, lr_scale=1.5)
    assert plain["lr"] == VARIANTS["lora_mlp_span"].module["lr"] and scaled["lr"] == 1.5 * plain["lr"]
    assert {k: v for k, v in scaled.items() if k != "lr"} == {k: v for k, v in plain.items() if k != "lr"}
    assert plain["scheduler"] == "cosine" and plain["total_steps"] == VARIANTS["lora_mlp_span"].steps
    assert plain["removal_order"] == [2, 3, 1] and plain["lora_b_lr_scale"] == 4.0
    gate = training_arguments(VARIANTS["gate"], {})
    assert gate["scheduler"] == "constant" and gate["lr"] == 5e-3 and gate["skip_image_positions"] is False
    budget = training_arguments(VARIANTS["lora_mlp_span"], removal, decay_over="budget")  # BudgetDecay drives it
    assert budget["scheduler"] == "cosine" and budget["total_steps"] is None
    assert {k: v for k, v in budget.items() if k != "total_steps"} == {k: v for k, v in plain.items() if k != "total_steps"}


def test_training_precision_follows_the_device_and_the_options(monkeypatch):
    import bench.training as training

    monkeypatch.setattr(training, "fast_bf16", lambda device: device == "cuda")
    assert training.training_precision("cpu") == ("32-true", None)  # no fast bf16 kernels: fp32 steps, fp32 weights
    assert training.training_precision("cuda") == ("bf16-mixed", "bfloat16")
    assert training.training_precision("cpu", "bf16-mixed") == ("bf16-mixed", "bfloat16")
    assert training.training_precision("cuda", "32-true", None, "bfloat16") == ("32-true", "bfloat16")
    assert training.training_precision("cuda", None, "float32") == ("bf16-mixed", None)


def test_adapters_trained_otherwise_are_found_before_any_work(tmp_path):
    from bench.training import recipe_digest, stale_runs, training_key
    from bench.variants import removal_settings

    variants = selected_variants(["lora_mlp_joint_plain", "lora_mlp_span", "routed_static", "gate"])
    orders = {"impact": [1, 2, 3], "joint": [3, 1, 2], "span": [2, 3, 1]}
    expected = {v.name: removal_settings(v, orders, 3, 2) for v in variants}
    assert expected["gate"] == {}  # per-token policies remove nothing
    assert expected["lora_mlp_joint_plain"] == {"removal_order": [3, 1, 2], "max_removed_blocks": 2, "min_removed_blocks": 2}
    assert expected["lora_mlp_span"]["removal_order"] == [2, 3, 1]
    assert expected["routed_static"] == {"removal_order": [1, 2, 3], "max_removed_blocks": 3, "min_removed_blocks": 0}
    elastic = removal_settings(VARIANTS["lora_mlp_span_elastic"], orders, 3, 2, min_target_blocks=1)
    assert elastic == {"removal_order": [2, 3, 1], "max_removed_blocks": 3, "min_removed_blocks": 1}  # every target's
    for variant in variants:  # as train_variant records them
        (tmp_path / variant.name).mkdir()
        info = {"steps": 3, "removal_order": None, **expected[variant.name], "recipe": recipe_digest(variant)}
        (tmp_path / variant.name / "train_info.json").write_text(json.dumps(info))
    assert stale_runs(variants, tmp_path, expected) == []
    orders["joint"] = [1, 3, 2]  # the joint order searched again
    stale = stale_runs(variants, tmp_path, {v.name: removal_settings(v, orders, 3, 2) for v in variants})
    assert len(stale) == 1 and "lora_mlp_joint_plain" in stale[0] and "[1, 3, 2]" in stale[0]
    # Gates pulled to a compute target that counted every position (before it counted the answer tokens) are stale.
    keys = {v.name: training_key(v, expected[v.name]) for v in variants}
    assert keys["gate"] == {"recipe": recipe_digest(VARIANTS["gate"]), "overrides": None,
                            "compute_counted_on": "answer positions", "skip_image_positions": False}
    assert training_key(VARIANTS["gate_lora_candidates_text"], {})["compute_counted_on"] == "real text positions"
    assert keys["routed_static"] == {**expected["routed_static"], "recipe": recipe_digest(VARIANTS["routed_static"]),
                                     "overrides": None}
    stale = stale_runs(variants, tmp_path, keys)
    assert len(stale) == 1 and "gate" in stale[0] and "compute_counted_on" in stale[0]
    # Gates trained with image positions skipping, measured with them running, are stale too.
    info = {"steps": 3, "compute_counted_on": "answer positions", "skip_image_positions": True,
            "recipe": recipe_digest(VARIANTS["gate"])}
    (tmp_path / "gate" / "train_info.json").write_text(json.dumps(info))
    stale = stale_runs(variants, tmp_path, keys)
    assert len(stale) == 1 and "skip_image_positions" in stale[0]
    # LoRA healing decayed over its steps is stale for a run that decays over the budget, and the gates unaffected.
    budget = {v.name: training_key(v, expected[v.name], "budget") for v in variants}
    assert budget["lora_mlp_span"] == {**expected["lora_mlp_span"],
                                       "recipe": recipe_digest(VARIANTS["lora_mlp_span"], "budget"),
                                       "overrides": None, "decay_over": "budget"}
    assert budget["gate"] == keys["gate"] and budget["routed_static"] == keys["routed_static"]
    stale = stale_runs(variants, tmp_path, budget)
    assert sorted(line.split(": ")[0].rsplit("/", 1)[-1] for line in stale) == ["gate", "lora_mlp_joint_plain",
                                                                              "lora_mlp_span"]
    # An adapter trained on another build of the real VLM (a rebuilt projector: the teacher's outputs on every image
    # differ) is stale, whatever its removal; one trained on this build is not.
    (tmp_path / "routed_static" / "train_info.json").write_text(json.dumps(
        {"steps": 3, **expected["routed_static"], "backbone_weights": "aaaa",
         "recipe": recipe_digest(VARIANTS["routed_static"])}))
    built = {"routed_static": training_key(VARIANTS["routed_static"], expected["routed_static"], "budget", "aaaa")}
    assert built["routed_static"]["backbone_weights"] == "aaaa"
    assert stale_runs([VARIANTS["routed_static"]], tmp_path, built) == []
    built = {"routed_static": training_key(VARIANTS["routed_static"], expected["routed_static"], "budget", "bbbb")}
    (stale,) = stale_runs([VARIANTS["routed_static"]], tmp_path, built)
    assert "routed_static" in stale and "'backbone_weights': 'aaaa'" in stale and "bbbb" in stale


def test_an_adapter_healed_by_hand_is_reused_only_as_the_variant_trains_it(tmp_path):
    from bench.training import recipe_digest, stale_runs, training_key
    from bench.variants import removal_settings

    variants = selected_variants(["lora_mlp_span_layer"])
    orders = {"impact": [4, 2, 3, 1], "joint": [3, 1, 2, 4], "span": [3, 2, 1, 4]}
    keys = {v.name: training_key(v, removal_settings(v, orders, 3, 2), "budget") for v in variants}

    def recorded(order, **extra):
        (tmp_path / "lora_mlp_span_layer").mkdir(exist_ok=True)
        info = {"removal_order": order, "max_removed_blocks": 2, "min_removed_blocks": 2, "decay_over": "budget",
                "recipe": recipe_digest(variants[0], "budget"), **extra}
        (tmp_path / "lora_mlp_span_layer" / "train_info.json").write_text(json.dumps(info))

    recorded([3, 2, 1, 4])
    assert stale_runs(variants, tmp_path, keys) == []
    # `bench.heal --removal 2 3`: the same two layers, but the adapter's own order decides which layers its rows at
    # the other targets remove (its first one at 10 %, and too few at 30 %).
    recorded([2, 3])
    assert len(stale_runs(variants, tmp_path, keys)) == 1
    # An adapter measured at its own target only removes all of its order at every step and in every row: the same
    # layers given by hand in another order are the same adapter, other layers are not.
    (t10,) = selected_variants(["lora_mlp_span_layer_t10"])
    t10_key = {t10.name: training_key(t10, removal_settings(t10, orders, 3, 2, target_blocks={0.1: 2}), "budget")}
    assert t10_key[t10.name]["removal_order"] == [3, 2]
    for order, stale in (([2, 3], 0), ([3, 2], 0), ([3, 1], 1), ([3, 2, 1], 1)):
        (tmp_path / t10.name).mkdir(exist_ok=True)
        (tmp_path / t10.name / "train_info.json").write_text(json.dumps(
            {"removal_order": order, "max_removed_blocks": 2, "min_removed_blocks": 2, "decay_over": "budget",
             "recipe": recipe_digest(t10, "budget")}))
        assert len(stale_runs([t10], tmp_path, t10_key)) == stale, order
    recorded([3, 2, 1, 4], overrides={"replacement_epochs": 16})  # `bench.heal --set`: another recipe
    (stale,) = stale_runs(variants, tmp_path, keys)
    assert "overrides" in stale and "replacement_epochs" in stale
    # The variant's definition changed since (its passes, say): the adapter it trained before is stale.
    changed = dataclasses.replace(variants[0], module={**variants[0].module, "replacement_epochs": 16})
    assert recipe_digest(changed, "budget") != recipe_digest(variants[0], "budget")
    recorded([3, 2, 1, 4])
    (stale,) = stale_runs([changed], tmp_path, {changed.name: training_key(
        changed, removal_settings(changed, orders, 3, 2), "budget")})
    assert "recipe" in stale
    # The digest is of what trains: a dict built in another key order reads the same, and a step count reads only
    # where the rate decays over it.
    shuffled = dataclasses.replace(changed, module=dict(reversed(list(changed.module.items()))))
    assert recipe_digest(shuffled, "budget") == recipe_digest(changed, "budget")
    longer = dataclasses.replace(changed, steps=2 * changed.steps)
    assert recipe_digest(longer, "budget") == recipe_digest(changed, "budget")
    assert recipe_digest(longer, "steps") != recipe_digest(changed, "steps")


def test_train_only_trains_every_variant_for_its_own_removal_and_measures_nothing(monkeypatch, tmp_path):
    import types

    import bench.data
    import bench.real_vlm
    from bench import run

    config = types.SimpleNamespace(get_text_config=lambda: types.SimpleNamespace(num_hidden_layers=30))
    monkeypatch.setattr(bench.data, "write_bench_shards", lambda: {"root": "shards"})
    monkeypatch.setattr(bench.real_vlm, "build_real_vlm", lambda: "vlm")
    monkeypatch.setattr(bench.real_vlm, "weights_digest", lambda path: "digest")
    monkeypatch.setattr(run, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(run, "training_shards", lambda manifest: {})
    monkeypatch.setattr(run, "load_for_measuring", lambda args, manifest: (
        types.SimpleNamespace(config=config), None, types.SimpleNamespace(calibration=[]), None))
    monkeypatch.setattr(run, "search_key", lambda model, calibration: {})
    impact = [20, 13, 14, 26, 15, 16, 17, 18, 25, 24, 12]
    monkeypatch.setattr(run, "rank_blocks", lambda *a, **k: impact)
    monkeypatch.setattr(run, "joint_removal_order", lambda *a, **k: impact[:9])
    span_then_greedy, searched = [14, 16, 13, 15, 17, 18, 26, 25, 24], []  # the 20 % span (6), continued to 9
    monkeypatch.setattr(run, "span_removal_order", lambda model, calibration, order, span_blocks, num_blocks, *a, **k:
                        searched.append((span_blocks, num_blocks)) or
                        (span_then_greedy[:num_blocks] if span_blocks == 6 else list(range(12, 12 + span_blocks))))
    trained = {}
    monkeypatch.setattr(run, "train_variant", lambda variant, *a, removal, **k: trained.update(
        {variant.name: removal}) or {"steps": 1})
    monkeypatch.setattr(run, "Bench", lambda *a, **k: pytest.fail("--train-only measured"))
    names = ["lora_mlp_span_layer_t10", "lora_mlp_span_layer", "lora_mlp_span_layer_t30", "gate"]
    assert run.main(["--train-only", "--variants", *names, "--runs", str(tmp_path / "runs"),
                     "--out", str(tmp_path / "out")]) == 0
    assert list(trained) == names
    assert {name: trained[name].get("max_removed_blocks") for name in names} == {
        "lora_mlp_span_layer_t10": 3, "lora_mlp_span_layer": 6, "lora_mlp_span_layer_t30": 9, "gate": None}
    assert trained["lora_mlp_span_layer_t10"]["removal_order"] == [14, 16, 13]  # what it removes: measured there only
    assert trained["lora_mlp_span_layer"]["removal_order"] == [14, 16, 13, 15, 17, 18, 26, 25, 24]  # rows at 10-30 %
    assert trained["lora_mlp_span_layer_t30"]["removal_order"] == list(range(12, 21))  # the cheapest span of its 9
    assert searched == [(6, 9), (9, 9)]  # the speed target's span continued to the largest target, then its own
    assert not (tmp_path / "out" / "results.json").exists()


def test_one_adapter_per_operating_point_trains_and_is_measured_at_its_own_target(monkeypatch):
    import bench.sweep
    from bench.variants import own_span_key, removal_settings

    orders = {"impact": [1, 2, 3], "joint": [3, 1, 2], "span": [2, 3, 1]}
    counts = {0.1: 1, 0.2: 2, 0.3: 3}
    t10, t30 = VARIANTS["lora_mlp_span_t10"], VARIANTS["lora_mlp_span_t30"]
    assert removal_settings(t10, orders, 3, 2, 1, counts) == {"removal_order": [2], "max_removed_blocks": 1,
                                                              "min_removed_blocks": 1}  # only what it removes
    assert removal_settings(t30, orders, 3, 2, 1, counts)["min_removed_blocks"] == 3
    assert removal_settings(VARIANTS["lora_mlp_span"], orders, 3, 2, 1, counts)["max_removed_blocks"] == 2
    with pytest.raises(SystemExit, match="lora_mlp_span_t30.*0.3"):  # refused before any training
        removal_settings(t30, orders, 2, 2, 1, {0.1: 1, 0.2: 2})
    # With `own_span` its blocks are the cheapest span of its own length, not the speed target's span continued.
    own = dataclasses.replace(t30, own_span=True)
    with pytest.raises(KeyError):  # a run that searched no span of 3 cannot say what it removes
        removal_settings(own, orders, 3, 2, 1, counts)
    assert removal_settings(own, {**orders, own_span_key(3): [5, 4, 6]}, 3, 2, 1, counts)["removal_order"] == [5, 4, 6]
    measured = []
    monkeypatch.setattr(bench.sweep, "measure_adapter",
                        lambda bench_, name, policy, adapter_dir, targets, speed_target, *a, **k:
                        measured.append((name, targets, speed_target)) or [])
    monkeypatch.setattr(bench.sweep, "measure_baselines", lambda *a, **k: [])
    monkeypatch.setattr(bench.sweep, "router_overhead_by_block_size", lambda *a, **k: {})
    monkeypatch.setattr("bench.resume.measured_key", lambda *a, **k: {})  # no trained adapters, no bench here
    monkeypatch.setattr("bench.resume.store_measurement", lambda *a, **k: None)
    bench.sweep.sweep(None, [0.1, 0.2, 0.3], [VARIANTS["lora_mlp_span"], t10, t30], 0.2, [1, 2, 3], [3, 1, 2],
                      lambda: None, Path("runs"), lambda message: None)
    assert measured == [("lora_mlp_span", [0.1, 0.2, 0.3], 0.2), ("lora_mlp_span_t10", [0.1], 0.1),
                        ("lora_mlp_span_t30", [0.3], 0.3)]


def test_router_overhead_is_measured_per_block_size_against_the_plain_model():
    bench = _bench()
    measured = router_overhead_by_block_size(bench, (1, 3), rounds=2)
    # 6 layers: blocks of 1 -> routers before blocks 1-5 and the final norm; blocks of 3 -> before block 1 and final.
    assert {size: entry["routers"] for size, entry in measured.items()} == {"1": 6, "3": 2}
    assert all(entry["overhead"] > 0 and 0 < entry["time_share"] < 1 for entry in measured.values())
    # Which block size routes faster is a benchmark figure (RESULTS.md prints it): on a tiny model under a loaded
    # CPU the two shares come within noise of each other, so it is not asserted here.
    layers = resolve(bench.model).get_layers(bench.model)
    assert not any(entry.has_entry(layer) for layer in layers)  # nothing left attached


def test_routing_time_accumulates_over_forwards_and_leaves_the_adapter_as_it_was():
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    inputs = dict(tiny_inputs(tokenizer, batch=1))
    hooks = [entry.entry_hook(module) for module in adapter._entry_modules()]
    with torch.no_grad():
        reference = model(**inputs).logits
        with timed_routing(adapter) as spent:
            timed = model(**inputs).logits
            one_forward = spent[0]
            model(**inputs)
    assert torch.equal(timed, reference)  # timing does not change what is computed
    assert 0 < one_forward < spent[0]  # every forward adds to it
    assert [entry.entry_hook(module) for module in adapter._entry_modules()] == hooks  # the hooks are back
    share = routing_share(model, adapter, inputs, tokenizer.pad_token_id or 0, rounds=2, new_tokens=3)
    assert 0 < share < 1
    with adapter.disabled():  # the base function routes nothing: its hooks return at once
        assert routing_share(model, adapter, inputs, tokenizer.pad_token_id or 0, rounds=3, new_tokens=3) < share / 3


def test_paired_speed_ratios_alternate_the_order_so_a_drifting_machine_favours_neither_side(monkeypatch):
    import contextlib

    import bench.evaluate as evaluate

    active, calls = [], []

    def method_of(name):
        @contextlib.contextmanager
        def enter():
            active.append(name)
            yield
            active.pop()
        return enter

    def timed_generate(model, inputs, pad_token_id, new_tokens):
        # Both sides equally fast; the machine slows by 10 % of a call after every call. Each side's first call
        # costs 5 more (a device's one-off start-up), and only the warm-up's short calls pay it.
        if new_tokens == evaluate.WARM_UP_TOKENS:
            calls.append(("warm-up", active[-1]))
            return 6.0
        calls.append(active[-1])
        return 1.0 + 0.1 * (len([c for c in calls if isinstance(c, str)]) - 1)

    monkeypatch.setattr(evaluate, "timed_generate", timed_generate)
    base, other = method_of("base"), method_of("other")
    ratios = evaluate.paired_speed_ratios(None, {}, other, base, 0, rounds=4, new_tokens=8)
    assert calls == [("warm-up", "base"), ("warm-up", "other")] + ["base", "other", "other", "base"] * 2  # ABBA
    assert ratios == pytest.approx([1.0 / 1.1, 1.3 / 1.2, 1.4 / 1.5, 1.7 / 1.6])
    calls.clear()
    # The median of paired rounds stays at ~1; one side always first would read 0.91-0.94 (the later call slower).
    assert evaluate.speed_ratio(None, {}, other, base, 0, rounds=4) == pytest.approx(1.0, abs=0.01)


def test_update_oracle_calibrates_on_the_fraction_it_realises_while_skipping():
    from bench.baselines import UpdateOracle

    model, tokenizer = tiny_vlm("llama", num_hidden_layers=8)
    batches = [dict(tiny_inputs(tokenizer, batch=2)), dict(tiny_inputs(tokenizer, batch=2))]
    oracle = UpdateOracle(model, range(1, 8), resolve(model).get_layers(model))
    realised = oracle.calibrate(batches, 0.3, tolerance=0.02)
    assert abs(realised - 0.3) <= 0.02
    thresholds = dict(oracle.thresholds)
    # What calibrate reports is what skipping realises on those batches: counted over their real tokens.
    current = {}
    with oracle.skipping(real=current) as count, torch.no_grad():
        for batch in batches:
            current["real"] = batch["attention_mask"].bool()
            model(**batch)
    assert count.skip_fraction == pytest.approx(realised)
    assert count.skipped_layer_fraction == pytest.approx(realised * 7 / 8)  # over all 8 layers, as SkipReport counts
    # The plain quantile (the level before bisection) realises another fraction on this model.
    assert abs(oracle.calibrate(batches, 0.3, max_steps=0) - 0.3) > 0.02
    assert oracle.thresholds != thresholds


def test_update_oracle_can_count_its_target_on_the_answer_tokens():
    from bench.baselines import UpdateOracle

    model, tokenizer = tiny_vlm("llama", num_hidden_layers=8)
    batches = [dict(tiny_inputs(tokenizer, batch=2)), dict(tiny_inputs(tokenizer, batch=2))]
    for batch in batches:  # the last third of each sequence answers
        answers = torch.zeros_like(batch["attention_mask"])
        answers[:, 2 * answers.shape[1] // 3:] = 1
        batch["loss_mask"] = answers
    oracle = UpdateOracle(model, range(1, 8), resolve(model).get_layers(model))
    realised = oracle.calibrate(batches, 0.3, tolerance=0.02, counted_on="response")
    assert abs(realised - 0.3) <= 0.02
    # Counted over the answer tokens while skipping, the realised fraction is the one calibrate reported.
    current = {}
    with oracle.skipping(real=current) as answers_count, torch.no_grad():
        for batch in batches:
            current["real"] = batch["loss_mask"].bool()
            model(**{k: v for k, v in batch.items() if k != "loss_mask"})
    assert answers_count.skip_fraction == pytest.approx(realised)
    on_text = UpdateOracle(model, range(1, 8), resolve(model).get_layers(model))
    on_text.calibrate(batches, 0.3, tolerance=0.02)  # the loss_mask is not a model input either way
    assert on_text.thresholds != oracle.thresholds  # the answers' updates are another distribution
    with pytest.raises(ValueError, match="loss_mask"):
        oracle.calibrate([{k: v for k, v in batch.items() if k != "loss_mask"} for batch in batches], 0.3,
                         counted_on="response")


def test_update_oracle_can_keep_image_positions_running_and_count_text_positions():
    from bench.baselines import UpdateOracle

    model, processor = tiny_vlm("llava", num_hidden_layers=8)
    batches = [dict(tiny_inputs(processor, batch=2)), dict(tiny_inputs(processor, batch=2))]
    image_ids = resolve(model).image_token_ids(model.config)
    layers = resolve(model).get_layers(model)
    kept = UpdateOracle(model, range(1, 8), layers, image_token_ids=image_ids)
    realised = kept.calibrate(batches, 0.3, tolerance=0.02)
    assert abs(realised - 0.3) <= 0.02  # the target counts real text positions
    skipped, current = {"image": 0, "text": 0}, {}

    def count_skips(module, args, kwargs, output):  # registered after the oracle's hook: sees its choice
        hidden = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        unchanged = (out == hidden).all(-1)
        skipped["image"] += int(unchanged[current["image"]].sum())
        skipped["text"] += int(unchanged[~current["image"]].sum())

    with kept.skipping(real=current) as count, torch.no_grad():
        handles = [layers[i].register_forward_hook(count_skips, with_kwargs=True) for i in range(1, 8)]
        try:
            for batch in batches:
                current["real"] = batch["attention_mask"].bool()
                current["image"] = torch.isin(batch["input_ids"], torch.tensor(sorted(image_ids)))
                assert current["image"].any()
                model(**batch)
        finally:
            for handle in handles:
                handle.remove()
    assert skipped["image"] == 0 and skipped["text"] > 0
    assert count.text_skip_fraction == pytest.approx(realised) and count.text_total < count.total
    assert count.skip_fraction < count.text_skip_fraction  # image positions count as running every layer
    assert count.skipped_text_layer_fraction == pytest.approx(realised * 7 / 8)


def test_span_order_starts_with_the_cheapest_span_and_is_cached_under_its_settings(tmp_path):
    from bench.orders import span_removal_order
    from vlm_retrofit.skipping import best_removal_span

    bench = _bench()
    calibration, removal_order, logged = bench.data.calibration, [2, 3, 1, 4], []
    order = span_removal_order(bench.model, calibration, removal_order, 2, 3, tmp_path, logged.append)
    identity = attach_routers(bench.model, RouterConfig(block_size=1))
    span, _ = best_removal_span(identity, calibration, 2)
    identity.detach()
    assert order[:2] == [b for b in removal_order if b in span] and len(set(order)) == 3
    assert "removal spans of 2" in logged[0]
    saved = json.loads((tmp_path / "span_removal_order-2.json").read_text())
    assert saved["order"] == order and saved["span_blocks"] == 2
    saved["order"] = [4, 3, 2]  # the cache answers while its settings match, and only then
    (tmp_path / "span_removal_order-2.json").write_text(json.dumps(saved))
    assert span_removal_order(bench.model, calibration, removal_order, 2, 3, tmp_path, logged.append) == [4, 3, 2]
    assert span_removal_order(bench.model, calibration, removal_order, 3, 3, tmp_path, logged.append) != [4, 3, 2]
    # Other calibration batches, or other weights (e.g. a rebuilt model), search again.
    (tmp_path / "span_removal_order-2.json").write_text(json.dumps(saved))
    other = [dict(batch, attention_mask=batch["attention_mask"].flip(-1)) for batch in calibration]
    assert span_removal_order(bench.model, other, removal_order, 2, 3, tmp_path, logged.append) != [4, 3, 2]
    (tmp_path / "span_removal_order-2.json").write_text(json.dumps(saved))
    with torch.no_grad():
        next(bench.model.parameters()).add_(1e-3)
    assert span_removal_order(bench.model, calibration, removal_order, 2, 3, tmp_path, logged.append) != [4, 3, 2]
    # A key computed once by the caller is the one the cache is stored and checked under.
    from bench.orders import search_key

    key = search_key(bench.model, calibration)
    span_removal_order(bench.model, calibration, removal_order, 2, 3, tmp_path, logged.append, key=key)
    saved = json.loads((tmp_path / "span_removal_order-2.json").read_text())
    assert saved["key"] == key
    saved["order"] = [4, 3, 2]
    (tmp_path / "span_removal_order-2.json").write_text(json.dumps(saved))
    assert span_removal_order(bench.model, calibration, removal_order, 2, 3, tmp_path, logged.append, key=key) == [4, 3, 2]
    assert span_removal_order(bench.model, calibration, removal_order, 2, 3, tmp_path, logged.append,
                              key={**key, "model": "another"}) != [4, 3, 2]


def test_per_token_candidates_are_half_again_the_blocks_a_static_removal_takes():
    from bench.measuring import candidate_count

    from vlm_retrofit import RouterConfig

    per_layer, per_three = RouterConfig(block_size=1).layout(30), RouterConfig(block_size=3).layout(30)
    assert [candidate_count(per_layer, t) for t in (0.1, 0.2, 0.3)] == [5, 9, 14]
    assert [candidate_count(per_three, t) for t in (0.1, 0.2, 0.3)] == [2, 3, 5]
    assert candidate_count(RouterConfig(block_size=1).layout(6), 0.9) == 4  # capped at the skippable blocks


def test_blocks_a_policy_was_trained_to_skip_come_first_among_its_candidates():
    from bench.measuring import candidates_at
    from bench.sweep import cheapest_blocks

    model, _ = tiny_vlm("llama", num_hidden_layers=6)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    ranked = cheapest_blocks(adapter, None, [1, 2, 3, 4])
    assert ranked == [1, 2, 3, 4]
    assert candidates_at(adapter, ranked, 0.3) == [1, 2, 3]  # candidate_count: 1.5 x the 2 blocks removed
    adapter.skip_candidates = [4, 2]
    assert candidates_at(adapter, ranked, 0.3) == [1, 2, 4]
    assert candidates_at(adapter, ranked, 0.15) == [2, 4]


def test_the_trained_candidate_rule_skips_among_the_trained_blocks_at_every_target():
    from bench.measuring import candidates_at

    model, _ = tiny_vlm("llama", num_hidden_layers=10)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    order = [5, 3, 7, 2, 6, 4, 1, 8]
    # Scaled: 1.5x the static removal's blocks, cheapest first, whatever the adapter was trained on.
    assert [candidates_at(adapter, order, t) for t in (0.1, 0.3)] == [[3, 5], [2, 3, 5, 6, 7]]
    adapter.skip_candidates = [7, 4, 1]
    assert [candidates_at(adapter, order, t, "trained") for t in (0.1, 0.3)] == [[1, 4, 7], [1, 4, 7]]
    adapter.skip_candidates = None  # trained on every block: the scaled rule
    assert candidates_at(adapter, order, 0.3, "trained") == candidates_at(adapter, order, 0.3)
    with pytest.raises(ValueError, match="candidate rule"):
        candidates_at(adapter, order, 0.3, "cheapest")


def test_measure_adapter_under_the_trained_rule_skips_the_trained_blocks_and_says_so(tmp_path):
    from bench.overhead import random_gates
    from bench.sweep import measure_adapter

    bench = _bench()
    adapter = attach_routers(bench.model, RouterConfig(block_size=1, skip_gate=True))
    random_gates(adapter)
    adapter.skip_candidates = [2, 4]  # not the cheapest two of the order below
    adapter.save_pretrained(tmp_path / "adapter")
    adapter.detach()
    bench.candidate_rule = "trained"
    records = measure_adapter(bench, "x", "gate", tmp_path / "adapter", [0.1], 1.0, [3, 1, 2, 4],
                              lambda: tiny_vlm("llama", num_hidden_layers=6)[0].eval(), lambda message: None)
    routers_only, skipping = records
    assert "candidate_blocks" not in routers_only
    assert skipping["candidate_blocks"] == [2, 4] and skipping["candidate_rule"] == "trained"
    assert skipping["tf_skipped_fraction"] == pytest.approx(0.1, abs=0.03)


def _lora_adapter_folder(bench: Bench, folder: Path, removal_order: list[int]) -> None:
    """A LoRA-healed static adapter as `fit` exports it: identity routers with a removal order, the LoRA in lora/."""
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_vlm("llama", num_hidden_layers=6)  # the same seeded weights as the bench's model
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))  # random B: the LoRA changes the function
    peft_model.save_pretrained(folder / "lora")
    adapter = attach_routers(bench.model, RouterConfig(block_size=1))
    adapter.removal_order = removal_order
    adapter.save_pretrained(folder)
    adapter.detach()


def test_measure_adapter_measures_a_lora_healed_adapter_routed_and_pruned(tmp_path):
    from bench.sweep import measure_adapter

    bench = _bench()
    base_model = bench.model
    _lora_adapter_folder(bench, tmp_path / "adapter", [2, 3, 1, 4])
    records = measure_adapter(bench, "x", "static", tmp_path / "adapter", [0.25], 0.25, [],
                              lambda: tiny_vlm("llama", num_hidden_layers=6)[0].eval(), lambda message: None)
    assert [(r["method"], r["target"]) for r in records] == [("ours-x", 0.0), ("ours-x", 0.25), ("ours-x-pruned", 0.25)]
    routers_only, routed, pruned = records
    assert routers_only["ppl_ratio"] != pytest.approx(1.0)  # the LoRA was merged in: not the base's function
    # Identity routers removing blocks compute what the pruned release computes: the same quality on every workload.
    for key in QUALITY:
        assert pruned[key] == pytest.approx(routed[key], abs=1e-4), key
    assert pruned["settings"]["blocks"] == [2, 3] and pruned["decode_speedup_b1"] > 0
    assert bench.model is base_model and bench.base_method is nullmethod  # the bench is left as it was found
    assert not any(entry.has_entry(layer) for layer in resolve(base_model).get_layers(base_model))


def test_bench_measure_refuses_a_folder_without_an_adapter_before_loading_anything(tmp_path):
    from bench.measure import main as measure_main

    with pytest.raises(SystemExit, match="adapter_config.json"):
        measure_main([str(tmp_path)])


def test_recorded_settings_name_repository_paths_relative_to_it():
    import argparse

    from bench.run import ROOT, recorded_settings

    args = argparse.Namespace(backbone=str(ROOT / ".cache" / "real_vlm"), runs=str(ROOT / ".cache" / "runs"),
                              out="/somewhere/else", targets=[0.2], device="cpu")
    settings = recorded_settings(args, leave_out=("runs",))
    assert settings == {"backbone": "bench/.cache/real_vlm", "out": "/somewhere/else", "targets": [0.2], "device": "cpu"}


def test_overhead_gate_threshold_skips_the_asked_share_of_the_text():
    """`python -m bench.overhead --gate-share`: random-query gates thresholded to skip the given share."""
    from bench.overhead import gate_threshold_for, random_gates

    model, tokenizer = tiny_vlm("llama", num_hidden_layers=8)
    adapter = attach_routers(model, RouterConfig(block_size=1, skip_gate=True))
    random_gates(adapter)
    inputs = dict(tiny_inputs(tokenizer, batch=1))
    with torch.no_grad():
        threshold = gate_threshold_for(model, adapter, inputs, tokenizer.pad_token_id, 0.2, new_tokens=8)
        with adapter.skipping("gate", threshold=threshold, skip_image_positions=False) as report:
            model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    assert 0.0 < threshold < 1.0
    assert abs(report.skipped_text_layer_fraction - 0.2) < 0.05, report.skipped_text_layer_fraction


def test_sparse_mlp_bench_times_the_prefill_side_by_side_and_defaults_to_the_gates():
    """`python -m bench.sparse_mlp`: bench.measure's command line with the gate policy, and a paired prefill ratio
    that runs each side inside its own context."""
    from bench.sparse_mlp import build_parser as sparse_parser, prefill_ratio

    args = sparse_parser().parse_args(["some/adapter"])
    assert (args.policy, args.targets, args.rounds, args.skip_image_positions) == ("gate", [0.2, 0.3], 6, False)
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    adapter = attach_routers(model, RouterConfig())
    inputs = dict(tiny_inputs(tokenizer, batch=1))
    entered = []

    def static():
        entered.append("static")
        return adapter.skipping("static", blocks=[1])

    with torch.no_grad():
        ratio = prefill_ratio(model, inputs, static, adapter.disabled, rounds=2)
    assert ratio > 0 and entered == ["static"] * 3  # one untimed call, then one per round


def test_a_variant_measured_by_an_earlier_run_is_reused_only_under_the_same_key(tmp_path, monkeypatch):
    # A run stopped while measuring goes on where it stopped: each variant's records are kept beside its adapter and
    # taken back whole (decode speed and the router overhead measured on it included) while nothing they depend on
    # changed; a retrained adapter, other settings or no --reuse-measured measure it again.
    import bench.sweep as sweep_module
    from bench.overhead import random_gates

    bench = _bench()
    bench.speed_rounds = 1
    runs = tmp_path / "runs"
    adapter = attach_routers(bench.model, RouterConfig(block_size=1, skip_gate=True))
    random_gates(adapter)
    adapter.save_pretrained(runs / "gates" / "adapter")
    adapter.detach()
    (runs / "gates" / "train_info.json").write_text(json.dumps({"steps": 3}))
    variant = dataclasses.replace(VARIANTS["gate"], name="gates")
    monkeypatch.setattr(sweep_module, "measure_baselines", lambda *args, **kwargs: [])
    monkeypatch.setattr(sweep_module, "router_overhead_by_block_size", lambda bench: {})
    monkeypatch.setattr(sweep_module, "router_overhead", lambda bench, adapter: (1.01, 0.05))  # 24 timed rounds
    measured = []
    real_measure_adapter = sweep_module.measure_adapter
    monkeypatch.setattr(sweep_module, "measure_adapter",
                        lambda *args, **kwargs: measured.append(args[1]) or real_measure_adapter(*args, **kwargs))

    def run(reuse: bool, speed_target: float = 0.2, machine: str = "cpu A"):  # (1.0: no point to time)
        return sweep_module.sweep(bench, [0.2], [variant], speed_target, [3, 1, 2, 4], [3, 1, 2, 4],
                                  lambda: tiny_vlm("llama", num_hidden_layers=6)[0].eval(), runs, lambda message: None,
                                  baseline_key={"caption_samples": 2}, reuse_measured=reuse, machine=machine)

    first, overhead = run(reuse=False)
    assert measured == ["gates"] and [r["target"] for r in first] == [0.0, 0.2]
    assert overhead["router_overhead"] == 1.01 and "decode_speedup_b1" in first[1]
    stored = json.loads((runs / "gates" / "measured.json").read_text())
    assert json.dumps(stored["records"]) == json.dumps(first)  # (NaN where the tiny base's ROUGE-L is 0)
    assert stored["overhead"]["router_overhead"] == overhead["router_overhead"]
    # Poison the stored quality: a reused record must come from the file, not from a fresh measurement.
    for record in stored["records"]:
        record["agreement"] = -1.0
    stored["overhead"]["router_overhead"] = 7.0
    (runs / "gates" / "measured.json").write_text(json.dumps(stored))

    reused, reused_overhead = run(reuse=True)
    assert measured == ["gates"]
    assert all(r["measured_in_earlier_run"] and r["agreement"] == -1.0 for r in reused)
    assert json.dumps([{k: v for k, v in r.items() if k not in ("agreement", "measured_in_earlier_run")}
                       for r in reused]) == json.dumps([{k: v for k, v in r.items() if k != "agreement"} for r in first])
    assert reused_overhead["router_overhead"] == 7.0
    run(reuse=True, speed_target=1.0)  # other settings: measured again, and stored under them
    assert measured == ["gates"] * 2
    assert run(reuse=True, speed_target=1.0)[0][0]["measured_in_earlier_run"] and measured == ["gates"] * 2
    run(reuse=True, speed_target=1.0, machine="cpu B")  # timed on another machine: measured again
    assert measured == ["gates"] * 3
    (runs / "gates" / "train_info.json").write_text(json.dumps({"steps": 4}))  # retrained
    assert "measured_in_earlier_run" not in run(reuse=True, speed_target=1.0)[0][0] and measured == ["gates"] * 4
    # Routers on the base whose stored run did not time the overhead: this run would time it on them, so they are
    # measured again rather than leave the overhead unmeasured.
    stored = json.loads((runs / "gates" / "measured.json").read_text())
    (runs / "gates" / "measured.json").write_text(json.dumps({**stored, "overhead": None}))
    assert run(reuse=True, speed_target=1.0)[1]["router_overhead"] == 1.01 and measured == ["gates"] * 5


def test_an_unreadable_or_foreign_measurement_file_is_not_reused(tmp_path):
    from bench.resume import earlier_measurement, store_measurement

    key = {"caption_samples": 2, "targets": [0.2]}
    assert earlier_measurement(tmp_path, key) is None  # none stored
    store_measurement(tmp_path, key, [{"method": "ours-x", "target": 0.2}], None)
    assert earlier_measurement(tmp_path, key)["records"] == [{"method": "ours-x", "target": 0.2}]
    assert earlier_measurement(tmp_path, {**key, "targets": [0.3]}) is None
    (tmp_path / "measured.json").write_text('{"key": ')  # cut short by hand: measured again, not a crash
    assert earlier_measurement(tmp_path, key) is None
    (tmp_path / "measured.json").write_text("[1, 2]")
    assert earlier_measurement(tmp_path, key) is None
