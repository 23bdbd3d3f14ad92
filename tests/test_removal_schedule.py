"""Removal schedule: routers trained to re-weight around blocks a static policy removes; impact ranking; persistence."""

import lightning.pytorch as pl
import pytest
import torch

from vlm_retrofit import AdapterMismatchError, RouterAdapter, RouterConfig, attach_routers, calibrate
from vlm_retrofit.skipping import best_removal_span, greedy_removal_order, removal_impact
from vlm_retrofit.testing import tiny_inputs, tiny_vlm
from vlm_retrofit.training import FixedBatchDataModule, RetrofitModule

LAYERS = {"num_hidden_layers": 6}


def _batches(n=2, seed=0):
    dm = FixedBatchDataModule(processor="tiny:llama", num_batches=n, val_batches=0, batch_size=2, seed=seed)
    dm.setup()
    return dm.train_batches


def _trainer(max_steps, **kw):
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, **kw)


def test_removed_blocks_in_simulation_equal_the_static_policy():
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[3, 2, 1],
                            max_removed_blocks=2, max_drop_rate=0.0)
    with torch.no_grad():
        for router in module.adapter.routers.values():
            router.query.normal_(0, 0.3)
    inputs, _ = module.model_inputs(_batches(1)[0])
    removed = module.removed_blocks(0, largest=True)
    assert removed == [3, 2]
    sim = module.simulation(0.0, seed=0, removed=removed)
    with torch.no_grad(), sim:
        simulated = module.model(**inputs).logits
    with torch.no_grad(), module.adapter.skipping("static", blocks=removed):
        static = module.model(**inputs).logits
    with torch.no_grad():
        full = module.model(**inputs).logits
    torch.testing.assert_close(simulated, static, atol=1e-5, rtol=0)
    assert (simulated - full).abs().max() > 1e-3  # the blocks really were removed
    assert all(sim.realised_keep[b] == 0.0 for b in removed)


def test_schedule_draws_prefixes_deterministically_and_validates():
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[4, 1, 2, 3],
                            max_removed_blocks=3)
    drawn = [module.removed_blocks(seed) for seed in range(40)]
    assert drawn == [module.removed_blocks(seed) for seed in range(40)]  # resumable: a function of the seed
    assert {len(d) for d in drawn} == {0, 1, 2, 3}
    assert all(d == [4, 1, 2, 3][:len(d)] for d in drawn)
    with pytest.raises(ValueError, match="cannot be skipped"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[0, 1], max_removed_blocks=1)
    with pytest.raises(ValueError, match="exceeds"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[1], max_removed_blocks=2)
    with pytest.raises(ValueError, match="needs a removal_order"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, max_removed_blocks=2)
    with pytest.raises(ValueError, match="min_removed_blocks"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[1, 2], max_removed_blocks=1,
                       min_removed_blocks=2)
    with pytest.raises(ValueError, match="skip_budget=1.0 lets a token skip 1 blocks, fewer than"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[1, 2], max_removed_blocks=2,
                       skip_budget=1.0)  # the removed blocks count against the budget


def test_schedule_with_a_floor_draws_only_prefixes_from_min_to_max():
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[4, 1, 2, 3],
                            max_removed_blocks=3, min_removed_blocks=2)
    assert {len(module.removed_blocks(seed)) for seed in range(40)} == {2, 3}
    fixed = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[4, 1, 2, 3],
                           max_removed_blocks=2, min_removed_blocks=2)
    assert all(fixed.removed_blocks(seed) == [4, 1] for seed in range(10))  # one operating point only



def test_removal_count_weights_set_how_often_each_count_is_drawn():
    weighted = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[4, 1, 2, 3],
                              max_removed_blocks=3, min_removed_blocks=1, removal_count_weights=[2, 1, 13])
    drawn = [weighted.removed_blocks(seed) for seed in range(400)]
    assert drawn == [weighted.removed_blocks(seed) for seed in range(400)]  # resumable: a function of the seed
    counts = [sum(len(d) == k for d in drawn) for k in (1, 2, 3)]
    assert all(d == [4, 1, 2, 3][:len(d)] for d in drawn)
    assert 0.06 < counts[0] / 400 < 0.19 and 0.01 < counts[1] / 400 < 0.12  # 1 / 8 and 1 / 16 of the draws
    assert 0.75 < counts[2] / 400 < 0.87  # 13 of 16 (binomial sd 0.02)
    assert weighted.removed_blocks(0, largest=True) == [4, 1, 2]
    # 0 is refused: every count of min..max is recorded as trained, so a release of it would pass untrained.
    for bad in ([1, 1], [1, -1, 1], [1, 0, 3], [1, float("nan"), 1]):
        with pytest.raises(ValueError, match="removal_count_weights must give 3 finite weights > 0"):
            RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[4, 1, 2, 3],
                           max_removed_blocks=3, min_removed_blocks=1, removal_count_weights=bad)

def test_removal_impact_ranks_blocks_and_static_calibration_follows_the_trained_order():
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS)
    adapter = module.adapter
    batches = [module.model_inputs(b)[0] for b in _batches(2)]
    impact = removal_impact(adapter, batches)
    assert set(impact) == set(adapter.layout.skippable_blocks)
    assert all(v > 0 for v in impact.values())
    # Removing one block alone: the KL of the static policy with that block, averaged over real tokens.
    block = max(impact, key=impact.__getitem__)
    with torch.no_grad():
        full = torch.log_softmax(adapter.model(**batches[0]).logits, -1)
        with adapter.skipping("static", blocks=[block]):
            removed = torch.log_softmax(adapter.model(**batches[0]).logits, -1)
    assert float((full.exp() * (full - removed)).sum(-1).mean()) > 0

    adapter.removal_order = [4, 3, 2, 1]
    result = calibrate(adapter, batches, 2 / 6, "static", store=False)
    assert result.settings == {"blocks": [3, 4]}
    assert calibrate(adapter, batches, 1 / 6, "static", store=False, order=[2, 1]).settings == {"blocks": [2]}


def _joint_kl(adapter, batches, blocks):
    """Mean KL(full || blocks removed) per real text token (image placeholders not scored), computed here
    independently of the library."""
    total = count = 0.0
    with torch.no_grad():
        for batch in batches:
            full = torch.log_softmax(adapter.model(**batch).logits.float(), -1)
            with adapter.skipping("static", blocks=list(blocks)):
                removed = torch.log_softmax(adapter.model(**batch).logits.float(), -1)
            kl = (full.exp() * (full - removed)).sum(-1)
            real = batch["attention_mask"].bool()
            image_id = getattr(adapter.model.config, "image_token_id", None)
            real = real & (batch["input_ids"] != image_id) if image_id is not None else real
            total, count = total + float(kl[real].sum()), count + int(real.sum())
    return total / count


def test_removals_are_scored_on_real_text_positions_only():
    from vlm_retrofit.skipping.calibrate import scored_positions

    model, tokenizer = tiny_vlm("llava", num_hidden_layers=6)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    batch = dict(tiny_inputs(tokenizer, batch=2))
    image = batch["input_ids"] == model.config.image_token_id
    assert image.any() and (~batch["attention_mask"].bool()).any()  # the tiny batch has both to leave out
    scored = scored_positions(adapter, batch, batch["input_ids"].shape)
    assert torch.equal(scored, batch["attention_mask"].bool() & ~image)
    impact = removal_impact(adapter, [batch])
    assert impact[2] == pytest.approx(_joint_kl(adapter, [batch], [2]), rel=1e-4)


def test_greedy_removal_order_picks_the_cheapest_block_given_those_already_removed():
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS)
    adapter = module.adapter
    batches = [module.model_inputs(b)[0] for b in _batches(2)]
    impact = removal_impact(adapter, batches)
    order, costs = greedy_removal_order(adapter, batches, 3)
    assert len(order) == len(set(order)) == 3 and set(order) <= set(adapter.layout.skippable_blocks)
    assert order[0] == min(impact, key=impact.__getitem__)
    for step in range(1, 3):  # each pick is the best completion of the previous picks, by brute force
        joint = {b: _joint_kl(adapter, batches, order[:step] + [b]) for b in adapter.layout.skippable_blocks
                 if b not in order[:step]}
        assert order[step] == min(joint, key=joint.__getitem__)
        assert costs[step] == pytest.approx(joint[order[step]], rel=1e-4)
    narrowed, _ = greedy_removal_order(adapter, batches, 2, candidates=[4, 2, 3])
    assert set(narrowed) <= {2, 3, 4}
    with pytest.raises(ValueError, match="not skippable"):
        greedy_removal_order(adapter, batches, 1, candidates=[0, 2])  # block 0 never skips
    with pytest.raises(ValueError, match="num_blocks"):
        greedy_removal_order(adapter, batches, 3, candidates=[2, 3])



@pytest.mark.parametrize("mode", ["joint", "span"])
def test_searched_removal_order_starts_with_the_search_picks_then_follows_impact(mode):
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=mode, max_removed_blocks=2)
    batch = _batches(1)[0]
    with torch.no_grad():
        module.compute_loss(batch, drop_rate=0.0, seed=0)  # the first batch seen decides the order
    order = list(module.adapter.removal_order)
    inputs = [module.model_inputs(batch)[0]]
    by_impact = sorted((impact := removal_impact(module.adapter, inputs)), key=impact.__getitem__)
    if mode == "joint":  # greedy joint removal's picks, in the order picked
        picks, _ = greedy_removal_order(module.adapter, inputs, 2)
    else:  # the cheapest span, its blocks by single-block impact
        span, _ = best_removal_span(module.adapter, inputs, 2)
        picks = [b for b in by_impact if b in span]
    assert order[:2] == picks
    assert order[2:] == [b for b in by_impact if b not in picks]
    assert sorted(order) == list(module.adapter.layout.skippable_blocks)
    with pytest.raises(ValueError, match="max_removed_blocks >= 1"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=mode)


def test_best_removal_span_is_the_cheapest_run_of_adjacent_blocks_and_greedy_continues_from_it():
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs={"num_hidden_layers": 8})
    adapter = module.adapter
    batches = [module.model_inputs(b)[0] for b in _batches(2)]
    span, costs = best_removal_span(adapter, batches, 3)
    skippable = list(adapter.layout.skippable_blocks)  # 1..6: the first and last blocks never skip
    assert sorted(costs) == [b for b in skippable if b + 2 <= skippable[-1]]  # every run of 3 inside 1..6
    for first, cost in costs.items():  # brute force: each run's joint removal KL
        assert cost == pytest.approx(_joint_kl(adapter, batches, [first, first + 1, first + 2]), rel=1e-4)
    assert span == [min(costs, key=costs.__getitem__) + i for i in range(3)]
    for impossible in (0, len(skippable) + 1):
        with pytest.raises(ValueError, match="num_blocks"):
            best_removal_span(adapter, batches, impossible)

    order, picked = greedy_removal_order(adapter, batches, 5, start=span)
    assert order[:3] == span and len(set(order)) == 5
    assert all(c != c for c in picked[:3])  # the start blocks are not searched (NaN)
    joint = {b: _joint_kl(adapter, batches, span + [b]) for b in skippable if b not in span}
    assert order[3] == min(joint, key=joint.__getitem__)
    with pytest.raises(ValueError, match="start"):
        greedy_removal_order(adapter, batches, 3, start=[0])
    with pytest.raises(ValueError, match="num_blocks"):
        greedy_removal_order(adapter, batches, 3, start=span)  # nothing left to pick


def test_impact_order_is_found_trained_saved_and_restored(tmp_path):
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order="impact",
                            max_removed_blocks=2, max_drop_rate=0.0, lr=3e-2, warmup_steps=0, scheduler="constant")
    data = FixedBatchDataModule(processor="tiny:llama", num_batches=2, val_batches=0, batch_size=2)
    batch = _batches(1)[0]
    with torch.no_grad():
        before = module.compute_loss(batch, drop_rate=0.0, seed=0, largest_removal=True).kl
    order = list(module.adapter.removal_order)
    impact = removal_impact(module.adapter, [module.model_inputs(batch)[0]])
    assert order == sorted(impact, key=impact.__getitem__)

    _trainer(60).fit(module, data)
    with torch.no_grad():
        after = module.compute_loss(batch, drop_rate=0.0, seed=0, largest_removal=True).kl
    assert after < 0.85 * before  # the routers learned to compensate for the removed blocks
    assert module.adapter.removal_order == order

    module.save_adapter(tmp_path / "adapter")
    fresh = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS)
    fresh.adapter.detach()
    loaded = RouterAdapter.from_pretrained(fresh.model, tmp_path / "adapter")
    assert loaded.removal_order == order and loaded.removal_range == module.adapter.removal_range == (0, 2)
    blocks = calibrate(loaded, [module.model_inputs(batch)[0]], 2 / 6, "static", store=False).settings["blocks"]
    assert blocks == sorted(order[:2])
    with pytest.warns(UserWarning, match="not what this adapter was trained for"):  # 3 blocks: beyond the schedule
        calibrate(loaded, [module.model_inputs(batch)[0]], 3 / 6, "static", store=False)

    # A resumed module restores the schedule from the checkpoint, whatever its own argument says.
    checkpoint = {"state_dict": module.trainable_state_dict(), "vlm_retrofit": module.checkpoint_metadata()}
    resumed = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order="impact",
                             max_removed_blocks=2)
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.adapter.removal_order == order and resumed.adapter.removal_range == (0, 2)
    # Resumed under another schedule, the record spans what both trained; one with a gap between them is refused.
    wider = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order="impact",
                           max_removed_blocks=3, min_removed_blocks=3)
    with pytest.warns(UserWarning, match="records 0..3 as trained"):
        wider.on_load_checkpoint(checkpoint)
    assert wider.adapter.removal_range == (0, 3)
    apart = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order="impact",
                           max_removed_blocks=4, min_removed_blocks=4)
    with pytest.raises(AdapterMismatchError, match="0..2 blocks and this run's .* say 4..4"):
        apart.on_load_checkpoint(checkpoint)
    # So does a checkpoint loaded for calibrate / merge (no Lightning): static calibration and pruning take its prefix.
    from vlm_retrofit.release import load_checkpoint

    torch.save({**checkpoint, "hyper_parameters": dict(module.hparams)}, tmp_path / "model.ckpt")
    from_checkpoint = load_checkpoint(tmp_path / "model.ckpt").adapter
    assert from_checkpoint.removal_order == order and from_checkpoint.removal_range == (0, 2)


def test_per_token_skipping_trained_on_candidate_blocks_only_is_saved_resumed_and_calibrated_on_them(tmp_path):
    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, router={"skip_gate": True},
                            skip_candidates=2, max_drop_rate=0.5, drop_warmup_steps=0, compute_target=0.8)
    batch = _batches(1)[0]
    out = module.compute_loss(batch, drop_rate=0.5, seed=0)
    impact = removal_impact(module.adapter, [module.model_inputs(batch)[0]])
    cheapest = sorted(sorted(impact, key=impact.__getitem__)[:2])
    assert module.adapter.skip_candidates == cheapest  # the count resolved on the first batch
    # Only the candidates are sampled: every other block runs for every token.
    assert set(out.realised_keep) == set(cheapest)
    assert all(keep < 1 for keep in out.realised_keep.values())
    sim = module.simulation(0.5, seed=1)
    with torch.no_grad(), sim:
        module.model(**module.model_inputs(batch)[0])
    assert set(sim.realised_keep) == set(cheapest)
    with pytest.raises(ValueError, match="candidate_blocks"):
        from vlm_retrofit.skipping import SkipSimulation
        SkipSimulation(module.adapter, candidate_blocks=[0])

    module.save_adapter(tmp_path / "adapter")
    fresh = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS)
    fresh.adapter.detach()
    loaded = RouterAdapter.from_pretrained(fresh.model, tmp_path / "adapter")
    assert loaded.skip_candidates == cheapest
    settings = calibrate(loaded, [batch], 0.2, "gate", store=False).settings  # its answers counted, as trained
    assert set(settings["threshold"]) == set(cheapest)  # calibrated on the blocks it was trained on

    checkpoint = {"state_dict": module.trainable_state_dict(), "vlm_retrofit": module.checkpoint_metadata()}
    # A checkpoint loaded for calibrate / merge (no Lightning) keeps them too.
    from vlm_retrofit.release import load_checkpoint

    torch.save({**checkpoint, "hyper_parameters": dict(module.hparams)}, tmp_path / "model.ckpt")
    from_checkpoint = load_checkpoint(tmp_path / "model.ckpt").adapter
    assert from_checkpoint.skip_candidates == cheapest and from_checkpoint.skip_image_positions
    resumed = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, router={"skip_gate": True},
                             skip_candidates=3)
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.adapter.skip_candidates == cheapest  # a resumed run samples the blocks it started with
    kept = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, skip_image_positions=False)
    assert kept.simulation(0.5, seed=0).skip_image_positions is False  # image positions run in training
    kept.save_adapter(tmp_path / "kept")
    loaded.detach()
    kept_loaded = RouterAdapter.from_pretrained(fresh.model, tmp_path / "kept")
    assert loaded.skip_image_positions and not kept_loaded.skip_image_positions
    settings = calibrate(kept_loaded, [module.model_inputs(batch)[0]], 0.2, "random", store=False).settings
    assert settings["skip_image_positions"] is False  # and calibration keeps them by default
    kept_resumed = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS)
    kept_resumed.on_load_checkpoint({"state_dict": kept.trainable_state_dict(), "vlm_retrofit": kept.checkpoint_metadata()})
    assert kept_resumed.adapter.skip_image_positions is False  # and keeps image positions as it started
    listed = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, skip_candidates=[4, 2])
    assert listed.adapter.skip_candidates == [2, 4]
    with pytest.raises(ValueError, match="candidates"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, skip_candidates=[0])
    with pytest.raises(ValueError, match="skip_candidates"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, skip_candidates=0)


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def test_lora_healing_without_routers_trains_the_lora_of_a_plainly_pruned_student():
    def module(train_routers):
        return RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, lora=LORA, removal_order=[3, 2, 1],
                              max_removed_blocks=2, min_removed_blocks=2, max_drop_rate=0.0, use_gates=False,
                              train_routers=train_routers, lr=1e-2, warmup_steps=0, scheduler="constant")

    batches = _batches(2)
    routed, plain = module(True), module(False)
    # At init the routers are the identity, so routing around the removed blocks is plain removal: same loss.
    with torch.no_grad():
        a = routed.compute_loss(batches[0], drop_rate=0.0, seed=0)
        b = plain.compute_loss(batches[0], drop_rate=0.0, seed=0)
    torch.testing.assert_close(b.kl, a.kl, atol=1e-5, rtol=0)
    assert b.kl > 1e-3 and b.realised_keep == {1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0}
    assert abs(b.realised_compute - 4 / 6) < 1e-9 and not b.entropy

    assert plain.trainable_keys() and all("lora_" in k for k in plain.trainable_keys())
    routers = {k: v.clone() for k, v in plain.adapter.state_dict().items()}
    lora = {k: v.clone() for k, v in plain.trainable_state_dict().items()}
    from vlm_retrofit.training import FixedBatchDataModule

    data = FixedBatchDataModule(processor="tiny:llama", num_batches=2, val_batches=0, batch_size=2, seed=0)
    _trainer(4).fit(plain, data)
    assert all(torch.equal(v, plain.adapter.state_dict()[k]) for k, v in routers.items())  # routers untouched
    assert any(not torch.equal(v, plain.trainable_state_dict()[k]) for k, v in lora.items())
    with torch.no_grad():
        assert plain.compute_loss(batches[0], drop_rate=0.0, seed=0).kl < b.kl  # the LoRA heals the removal
    # The student's forward is undone: the model has all its layers and the routers attached afterwards.
    assert len(plain.adapter.spec.get_layers(plain.model)) == 6


def test_lora_healing_without_routers_is_refused_without_what_it_needs():
    for kwargs in ({"lora": None}, {"max_removed_blocks": 0, "min_removed_blocks": 0}, {"max_drop_rate": 0.1}):
        args = {"lora": LORA, "removal_order": [3, 2], "max_removed_blocks": 2, "max_drop_rate": 0.0, **kwargs}
        with pytest.raises(ValueError, match="train_routers: false"):
            RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, train_routers=False, **args)


def test_hidden_state_term_compares_the_kept_layers_above_the_first_removed_one():
    from vlm_retrofit.training.losses import hidden_state_distillation

    module = RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, lora=LORA, removal_order=[3, 2, 1],
                            max_removed_blocks=2, min_removed_blocks=2, max_drop_rate=0.0, use_gates=False,
                            train_routers=False, hidden_weight=0.5)
    # Layers 2 and 3 deleted: the student runs 0, 1, 4, 5; its outputs of 4 and 5 are compared with the teacher's.
    assert module.hidden_state_pairs([3, 2]) == [(3, 5), (4, 6)]
    assert module.hidden_state_pairs([]) == []
    batch = _batches(1)[0]
    inputs, mask = module.model_inputs(batch)
    with torch.no_grad():
        with module.teacher():
            teacher = module.model(**inputs, output_hidden_states=True).hidden_states
        from vlm_retrofit.pruning import layers_removed

        with module.adapter.disabled(), layers_removed(module.model, module.adapter.spec, [2, 3]):
            student = module.model(**inputs, output_hidden_states=True).hidden_states
        out = module.compute_loss(batch, drop_rate=0.0, seed=0)
    # Entry j is the output of the j-th layer that ran: below the gap (LoRA at zero) the two streams agree.
    assert len(student) == 5 and len(teacher) == 7
    torch.testing.assert_close(student[2], teacher[2])
    expected = hidden_state_distillation(student, teacher, [(3, 5), (4, 6)], mask)
    torch.testing.assert_close(out.hidden, expected)
    assert out.hidden > 1e-4
    torch.testing.assert_close(out.loss, out.kl + out.penalty + 0.5 * out.hidden)

    with pytest.raises(ValueError, match="train_routers: false"):
        RetrofitModule(backbone="tiny:llama", backbone_kwargs=LAYERS, removal_order=[3, 2], max_removed_blocks=2,
                       hidden_weight=1.0)


@pytest.mark.parametrize("config, setting", [("tiny-removal.yaml", "removal_order"),
                                             ("tiny.yaml", "skip_candidates")])
def test_rankings_on_the_first_batch_are_made_on_a_training_batch_not_the_check_before_it(tmp_path, monkeypatch,
                                                                                          config, setting):
    # fit validates one batch before its first step; the rankings made on "the first batch seen" took that one,
    # chosen on validation data (and the val split is not the training mix).
    from conftest import fit_config

    made_while = []
    original = RetrofitModule._ensure_removal_order if setting == "removal_order" else RetrofitModule._ensure_skip_candidates

    def recorded(self, batch):
        before = getattr(self.adapter, setting)
        original(self, batch)
        if before is None and getattr(self.adapter, setting) is not None:
            made_while.append("sanity check" if self.trainer.sanity_checking else "training")

    monkeypatch.setattr(RetrofitModule, original.__name__, recorded)
    extra = () if setting == "removal_order" else ("--model.skip_candidates", "1")
    fit_config(tmp_path, config, "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1", *extra)
    assert made_while == ["training"]
