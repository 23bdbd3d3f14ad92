"""Skip semantics, budgets, never-skip blocks, accounting by hand, bad settings, and the training simulation."""

import warnings

import pytest
import torch
from transformers import DynamicCache

from vlm_retrofit import RouterAdapter, RouterConfig, attach_routers
from vlm_retrofit.errors import InputError
from vlm_retrofit.skipping import (LayerCost, PatternPolicy, RandomPolicy, SkipSimulation, StaticPolicy, block_influence,
                                   block_savings, calibrate)
from vlm_retrofit.testing import tiny_inputs, tiny_vlm


def _model(family="llama", layers=6, **config):
    model, processor = tiny_vlm(family, num_hidden_layers=layers)
    return model, processor, attach_routers(model, RouterConfig(**config))


def _logits(model, inputs, **kwargs):
    with torch.no_grad():
        return model(**inputs, **kwargs).logits


def test_skipping_at_uniform_routing_is_plain_layer_dropping():
    model, processor, adapter = _model("qwen2_vl")
    inputs = tiny_inputs(processor)
    with adapter.skipping(StaticPolicy(blocks=[2, 3])):
        skipped = _logits(model, inputs)
    adapter.detach()
    layers = model.get_decoder().layers
    handles = [layers[i].register_forward_hook(lambda m, args, kwargs, out: args[0] if args else kwargs["hidden_states"],
                                               with_kwargs=True) for i in (2, 3)]
    try:
        dropped = _logits(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(skipped, dropped, atol=1e-5, rtol=0)


def test_a_skipped_delta_is_absent_not_a_zero_source():
    model, processor, adapter = _model()
    inputs = tiny_inputs(processor)
    first_token_skips_block_2 = PatternPolicy(
        lambda block, state: (torch.arange(state.routed_input.shape[1]) == 0).expand(state.routed_input.shape[:-1])
        if block == 2 else None
    )
    with torch.no_grad(), adapter.skipping(first_token_skips_block_2):
        model(**inputs)
    alpha = adapter.last_routing_weights["3"]  # sources s0, then the deltas of blocks 0, 1, 2
    assert alpha.shape[0] == 4
    assert torch.all(alpha[3][:, 0] == 0), "skipped block's delta still takes routing weight"
    assert torch.all(alpha[3][:, 1:] > 0)
    torch.testing.assert_close(alpha[:, :, 0].sum(0), torch.ones(alpha.shape[1]))


def test_a_block_no_token_ran_is_dropped_from_the_stream_but_reported_per_source():
    model, processor, adapter = _model()
    inputs = tiny_inputs(processor)
    with torch.no_grad(), adapter.skipping(PatternPolicy(lambda block, state: _skip_everything(block, state)
                                                         if block == 2 else None)):
        model(**inputs)
    assert len(adapter._state.stack) == adapter.layout.num_blocks  # one of num_blocks + 1 sources dropped
    alpha = adapter.last_routing_weights["3"]  # still indexed by source: s0, then blocks 0, 1, 2
    assert alpha.shape[0] == 4 and torch.all(alpha[3] == 0)
    torch.testing.assert_close(alpha.sum(0), torch.ones_like(alpha[0]))


def _skip_everything(block, state):
    return torch.ones(state.routed_input.shape[:-1], dtype=torch.bool)


def test_never_skip_blocks_and_budget_are_honoured():
    model, processor, adapter = _model(never_skip_blocks=[0, 3, 5])
    inputs = tiny_inputs(processor)
    with torch.no_grad(), adapter.skipping(PatternPolicy(_skip_everything)) as report:
        model(**inputs)
    assert [r > 0 for r in report.skip_rates] == [False, True, True, False, True, False]
    with torch.no_grad(), adapter.skipping(PatternPolicy(_skip_everything), budget=2) as report:
        model(**inputs)
    assert report.skip_rates == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # the first two skippable blocks use the budget
    with torch.no_grad(), adapter.skipping(PatternPolicy(_skip_everything), budget=0.34) as report:
        model(**inputs)  # a third of 3 skippable blocks: 1
    assert report.skip_rates == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_skip_rates_count_real_tokens_only_in_a_padded_batch():
    model, processor, adapter = _model()
    inputs = tiny_inputs(processor, batch=2)
    real = inputs["attention_mask"].bool()
    assert not real.all()  # padded: the counts below must leave the padding out
    generator = torch.Generator().manual_seed(0)
    masks = {1: torch.rand(real.shape, generator=generator) < 0.5,  # some real and some padding positions skip
             2: torch.ones_like(real),                                # every position skips
             3: ~real,                                                # only the padding skips: no real token does
             4: torch.zeros_like(real)}                               # nobody skips
    with torch.no_grad(), adapter.skipping(PatternPolicy(lambda block, state: masks.get(block))) as report:
        model(**inputs)
    for block, mask in masks.items():
        assert report.block_tokens[block] == int(real.sum()), block
        assert report.block_skipped_tokens[block] == int((mask & real).sum()), block
    assert report.skip_rates[3] == report.skip_rates[4] == 0.0 and report.skip_rates[2] == 1.0
    # The decoder called directly (no mask) after a padded call of the model: every position counts, none of the
    # previous call's padding is taken for this one's.
    with torch.no_grad(), adapter.skipping(PatternPolicy(lambda block, state: masks.get(block))) as report:
        model(**inputs)
        model.get_decoder()(input_ids=inputs["input_ids"])
    assert report.block_tokens[1] == int(real.sum()) + real.numel()



def test_padding_decisions_hold_no_block_off_its_fast_paths():
    # Padding positions are nobody's output: a block every real token skips takes the kv-only path whatever the
    # padding decided, and a block only padding would skip runs in full, the same function at real positions.
    model, processor, adapter = _model()
    inputs = tiny_inputs(processor, batch=2)
    real = inputs["attention_mask"].bool()
    assert not real.all()
    runs = {}
    for name, masks in {"padding decides otherwise": {2: real, 3: ~real},
                        "padding decides the same": {2: torch.ones_like(real), 3: torch.zeros_like(real)}}.items():
        with torch.no_grad(), adapter.skipping(PatternPolicy(lambda block, state, m=masks: m.get(block))) as report:
            runs[name] = model(**inputs).logits
        assert report.layer_calls == {"full": 3, "mixed": 0, "kv_only": 1, "skipped": 0}, name
        assert report.skip_rates[2] == 1.0 and report.skip_rates[3] == 0.0
    torch.testing.assert_close(runs["padding decides otherwise"][real], runs["padding decides the same"][real])

@pytest.mark.parametrize("removed", [False, True])
def test_accounting_matches_a_hand_computed_case(removed):
    # llama tiny: d=64, 4 heads x 16, 2 kv heads, MLP 128; 4 layers, block 2 skipped by every token.
    model, processor, adapter = _model(layers=4)
    cost = LayerCost.from_config(model.config)
    assert (cost.dense, cost.kv_projection) == (2 * 64 * 64 + 4 * 64 * 32 + 2 * 64 * 64 + 3 * 2 * 64 * 128, 4 * 64 * 32)
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    per_layer_prefill = 5 * 73728 + 4 * 64 * (5 * 6 // 2)  # dense + causal attention over 15 (query, key) pairs
    per_layer_decode = 73728 + 4 * 64 * 6                # one new token attending to a context of 6
    # A static policy removes block 2 for the whole context: no token ever reads its cache, so none is written.
    # A per-token policy that happens to skip it for every token still writes its K/V (kv-only).
    policy = StaticPolicy(blocks=[2]) if removed else PatternPolicy(lambda block, state: _skip_everything(block, state)
                                                                    if block == 2 else None)
    kv_cost = 0 if removed else 8192
    with torch.no_grad(), adapter.skipping(policy) as report:
        cache = DynamicCache(config=model.config)
        model(input_ids=input_ids, cache=cache, use_cache=True)
        model(input_ids=torch.tensor([[10]]), cache=cache, use_cache=True)
    assert report.prefill.full_flops == 4 * per_layer_prefill
    assert report.prefill.executed_flops == 3 * per_layer_prefill + 5 * kv_cost
    assert report.decode.full_flops == 4 * per_layer_decode
    assert report.decode.executed_flops == 3 * per_layer_decode + kv_cost
    # Skippable blocks are 1 and 2 (0 and 3 never skip): block 1 ran in full, block 2 only wrote its K/V or
    # nothing. layer_calls counts the layers a policy may skip: the static policy leaves block 1 unpatched.
    expected_calls = {"full": 0, "mixed": 0, "kv_only": 0, "skipped": 2} if removed else {"full": 2, "mixed": 0, "kv_only": 2, "skipped": 0}
    assert report.layer_calls == expected_calls
    assert report.skip_rates == [0.0, 0.0, 1.0, 0.0]
    assert cache.get_seq_length() == 6
    assert [layer.keys.shape[2] if layer.is_initialized else 0 for layer in cache.layers] == [6, 6, 0 if removed else 6, 6]
    expected = 1 - (3 * (per_layer_prefill + per_layer_decode) + 6 * kv_cost) / (4 * (per_layer_prefill + per_layer_decode))
    assert report.compute_saved == pytest.approx(expected)


def test_bad_settings_are_refused_with_the_valid_choices():
    model, processor, adapter = _model()
    with pytest.raises(ValueError, match="valid policies: recent_weight, gate, static, random"):
        adapter.skipping("fastest")
    with pytest.raises(ValueError, match=r"skippable blocks are \[1, 2, 3, 4\]"):
        adapter.skipping("static", blocks=[0])
    with pytest.raises(ValueError, match=r"block\(s\) \[9\]"):
        adapter.skipping("recent_weight", thresholds={9: 0.5})
    with pytest.raises(ValueError, match="skip_gate=True"):
        adapter.skipping("gate")
    with pytest.raises(ValueError, match="calibrate"):
        adapter.skipping("recent_weight", target_saving=0.3)
    with pytest.raises(ValueError, match="budget"):
        adapter.skipping("random", rate=0.2, budget=-1)
    with pytest.raises(ValueError, match="less than one block per token"):  # 0.1 of 4 skippable blocks: none at all
        adapter.skipping("random", rate=0.2, budget=0.1)
    with pytest.raises(ValueError, match="missing a required argument: 'thresholds'.*target_saving="):
        adapter.skipping("recent_weight")
    with pytest.raises(ValueError, match="unexpected keyword argument 'threshold'.*Its settings: thresholds"):
        adapter.skipping("recent_weight", thresholds={1: 0.5}, threshold=0.5)


def test_a_calibration_off_its_target_warns():
    model, processor, adapter = _model()
    batches = [tiny_inputs(processor)]
    with pytest.warns(UserWarning, match="off the target by more than the tolerance 0.0"):
        result = calibrate(adapter, batches, 0.3, "random", tolerance=0.0, max_iterations=2, store=False)
    assert result.achieved_saving != 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate(adapter, batches, 0.3, "random", tolerance=1.0, store=False)  # within it: no warning


def test_simulation_is_the_inference_skip_function_and_trains_the_gates():
    model, processor, adapter = _model(skip_gate=True)
    inputs = tiny_inputs(processor)
    simulation = SkipSimulation(adapter, drop_rate=0.4, use_gates=True, generator=torch.Generator().manual_seed(0))
    with simulation:
        simulated = model(**inputs).logits
        masks = {block: ~simulation.ran(block) for block in adapter.layout.skippable_blocks}
    assert any(m.any() for m in masks.values()) and not all(m.all() for m in masks.values())
    # Replaying the sampled masks through the inference runtime gives the same logits.
    with torch.no_grad(), adapter.skipping(PatternPolicy(lambda block, state: masks.get(block))):
        replayed = model(**inputs).logits
    torch.testing.assert_close(simulated.detach(), replayed, atol=1e-5, rtol=0)
    # Straight-through gradients reach the gates; the compute estimate is differentiable too.
    expected = simulation.expected_compute()
    assert 0 < expected.item() < 1
    (simulated.float().pow(2).mean() + expected).backward()
    for block, gate in adapter.gates.items():
        assert gate.query.grad is not None and gate.query.grad.abs().sum() > 0, block
    assert set(simulation.realised_keep) == set(adapter.layout.skippable_blocks)
    assert all(0 <= keep <= 1 for keep in simulation.realised_keep.values())


def test_simulated_removed_blocks_count_against_the_budget_as_at_inference():
    model, processor, adapter = _model()  # blocks 1-4 skippable
    inputs = tiny_inputs(processor)
    # Every sampled block drops nearly every token and block 4 is removed: a budget of 2 leaves one sampled skip
    # per token, as a static policy's removed blocks use the budget at inference.
    simulation = SkipSimulation(adapter, drop_rate=0.999, use_gates=False, budget=2, removed_blocks=[4],
                                generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), simulation:
        model(**inputs)
        runs = {block: simulation.ran(block) for block in adapter.layout.skippable_blocks}
    assert runs[4] is False  # removed: no token runs it
    sampled_skips = sum((~runs[block]).int() for block in (1, 2, 3) if isinstance(runs[block], torch.Tensor))
    assert int(sampled_skips.max()) == 1 and float((~runs[1]).float().mean()) > 0.9  # block 1 takes what is left
    with pytest.raises(ValueError, match="smaller than the 2 removed blocks"):
        SkipSimulation(adapter, budget=1, removed_blocks=[3, 4])


def test_simulation_can_keep_image_positions_running():
    # As under a policy calibrated with skip_image_positions=False: image placeholders run every sampled block, and
    # their gates learn nothing from a decision that is not theirs.
    model, processor, adapter = _model("qwen2_vl", skip_gate=True)
    inputs = tiny_inputs(processor)
    image = torch.isin(inputs["input_ids"], torch.tensor(sorted(adapter.spec.image_token_ids(model.config))))
    assert image.any() and (~image).any()
    simulation = SkipSimulation(adapter, drop_rate=0.5, use_gates=True, skip_image_positions=False,
                                generator=torch.Generator().manual_seed(0))
    with simulation:
        model(**inputs)
        ran = {block: simulation.ran(block) for block in adapter.layout.skippable_blocks}
    for block, mask in ran.items():
        assert isinstance(mask, torch.Tensor) and mask[image].all() and not mask[~image].all(), block
        gate = adapter.gates[str(block)].query
        multiplier = simulation._multiplier[block]
        image_grad, = torch.autograd.grad(multiplier[image].sum(), gate, retain_graph=True, allow_unused=True)
        text_grad, = torch.autograd.grad(multiplier[~image].sum(), gate, retain_graph=True)
        assert (image_grad is None or not image_grad.any()) and text_grad.abs().sum() > 0, block


def test_simulated_compute_counts_only_the_given_positions():
    # Padding and image placeholders must not count towards the compute target: gates would meet it by
    # skipping them, and a decode runs neither.
    from vlm_retrofit.skipping.calibrate import scored_positions

    model, processor, adapter = _model("qwen2_vl", skip_gate=True)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # gates that tell tokens apart (at init every token runs with about the same probability)
        for gate in adapter.gates.values():
            gate.query.copy_(torch.randn(gate.query.shape, generator=generator))
    inputs = tiny_inputs(processor)
    counted = scored_positions(adapter, inputs, inputs["input_ids"].shape)
    assert not counted.all() and counted.any()  # the batch has both padding and image placeholders
    probabilities = {}
    handles = [gate.register_forward_hook(lambda module, args, out, block=int(block): probabilities.update({block: out}))
               for block, gate in adapter.gates.items()]
    try:
        for positions in (counted, None):
            simulation = SkipSimulation(adapter, drop_rate=0.3, use_gates=True, counted_positions=positions,
                                        generator=torch.Generator().manual_seed(0))
            with simulation:
                model(**inputs)
                ran = {block: simulation.ran(block) for block in adapter.layout.skippable_blocks}
            where = counted if positions is not None else torch.ones_like(counted)
            for block in adapter.layout.skippable_blocks:
                expected = probabilities[block][where].mean() * 0.7
                torch.testing.assert_close(simulation.expected_keep[block], expected)
                assert simulation.realised_keep[block] == pytest.approx(float(ran[block][where].float().mean()))
                if positions is not None:  # the rates over every position differ: the test tells them apart
                    assert abs(float(expected) - float(probabilities[block].mean() * 0.7)) > 1e-3
    finally:
        for handle in handles:
            handle.remove()
    # Nothing counted (a batch of padding only) counts every position rather than dividing by zero.
    assert SkipSimulation(adapter, counted_positions=torch.zeros_like(counted)).counted_positions is None


def _routed_with_gates():
    """8 layers (blocks 1-6 skippable) with random router queries and gates, and an image and a text-only batch."""
    model, processor, adapter = _model("qwen2_vl", layers=8, skip_gate=True)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for router in adapter.routers.values():
            router.query.copy_(0.5 * torch.randn(router.query.shape, generator=generator))
        for gate in adapter.gates.values():
            gate.query.copy_(torch.randn(gate.query.shape, generator=generator))
    return model, processor, adapter, [tiny_inputs(processor, batch=2), tiny_inputs(processor, batch=2, with_image=False)]


@pytest.mark.parametrize("policy", ["recent_weight", "gate", "static", "random"])
def test_calibration_reaches_its_target_on_the_calibration_data(policy, tmp_path):
    model, processor, adapter, batches = _routed_with_gates()
    result = calibrate(adapter, batches, target_saving=0.25, policy=policy)
    # Static removal moves in whole blocks (1 of 8 layers); the others are tuned to within the tolerance.
    tolerance = 0.125 if policy == "static" else 0.03
    assert abs(result.achieved_saving - 0.25) <= tolerance, result.summary()
    if policy in ("recent_weight", "gate"):  # image and text positions calibrated apart
        assert {"recent_weight": "image_thresholds", "gate": "image_threshold"}[policy] in result.settings
    # Stored with the adapter, and used by name.
    adapter.save_pretrained(tmp_path)
    adapter.detach()
    fresh, _ = tiny_vlm("qwen2_vl", num_hidden_layers=8)
    restored = RouterAdapter.from_pretrained(fresh, tmp_path)
    with torch.no_grad(), restored.skipping(policy, target_saving=0.25) as report:
        for batch in batches:
            fresh(**batch)
    assert report.skipped_layer_fraction == pytest.approx(result.achieved_saving, abs=1e-6)


def test_calibration_in_flops_charges_a_per_token_skip_its_kv_write_and_a_removal_nothing():
    model, processor, adapter, batches = _routed_with_gates()
    cost = LayerCost.from_config(adapter.spec.get_text_config(model))
    kept = 1 - cost.kv_projection / cost.dense  # a per-token skip still writes its K/V at decode
    skippable = adapter.layout.skippable_blocks
    assert {b: block_savings(adapter, "flops")[b] for b in skippable} == pytest.approx(dict.fromkeys(skippable, kept / 8))
    assert {b: block_savings(adapter, "flops", removed=True)[b] for b in skippable} == pytest.approx(
        dict.fromkeys(skippable, 1 / 8))
    result = calibrate(adapter, batches, target_saving=0.25, policy="gate", unit="flops", store=False)
    assert result.unit == "flops" and abs(result.achieved_saving - 0.25) <= 0.03, result.summary()
    with torch.no_grad(), adapter.skipping("gate", **result.settings) as report:
        for batch in batches:
            model(**batch)
    # More layers skipped than the FLOPs target: each skip saves `kept` of a layer.
    assert report.skipped_layer_fraction * kept == pytest.approx(result.achieved_saving, abs=1e-6)
    layers = calibrate(adapter, batches, target_saving=0.25, policy="gate", store=False)
    assert report.skipped_layer_fraction > layers.achieved_saving
    # A static removal writes no K/V: its FLOPs are its layers, the same blocks either way.
    assert (calibrate(adapter, batches, 0.25, "static", unit="flops", store=False).settings
            == calibrate(adapter, batches, 0.25, "static", store=False).settings)
    with pytest.raises(InputError, match="unit must be one of layers, flops"):
        calibrate(adapter, batches, 0.25, "gate", unit="seconds")


def test_shared_allocation_keeps_the_skipping_where_the_gates_put_it():
    model, processor, adapter, batches = _routed_with_gates()
    with torch.no_grad():  # scores spread around each gate's bias (3 at init): block 1 learned to run less, 5 more
        for gate in adapter.gates.values():
            gate.query.mul_(0.02)
        adapter.gates["1"].bias.fill_(0.0)
        adapter.gates["5"].bias.fill_(6.0)
    equal = calibrate(adapter, batches, target_saving=0.25, policy="gate", store=False)
    shared = calibrate(adapter, batches, target_saving=0.25, policy="gate", allocation="shared", store=False)
    assert shared.allocation == "shared" and abs(shared.achieved_saving - 0.25) <= 0.03, shared.summary()
    for key in ("threshold", "image_threshold"):  # one value for every block, per modality
        assert len(set(shared.settings[key].values())) == 1, shared.settings
    # Equal shares make block 5 take its part of the skipping; a shared threshold leaves it to block 1.
    assert equal.skip_rates[5] > 0.2, equal.skip_rates
    assert shared.skip_rates[1] > 0.9 and shared.skip_rates[5] < 0.05, shared.skip_rates
    with torch.no_grad(), adapter.skipping("gate", **shared.settings) as report:
        for batch in batches:
            model(**batch)
    assert report.skipped_layer_fraction == pytest.approx(shared.achieved_saving, abs=1e-6)
    with pytest.raises(InputError, match="allocation must be one of equal, shared"):
        calibrate(adapter, batches, 0.25, "gate", allocation="greedy")
    with pytest.raises(InputError, match="static has no scores to threshold"):
        calibrate(adapter, batches, 0.25, "static", allocation="shared")


def test_per_modality_calibration_skips_image_and_text_positions_at_the_same_rate():
    # One gate threshold for both modalities skips them at whatever rates their score distributions give;
    # calibrated apart, each skips the same share of its positions (what a text workload will then realise).
    from vlm_retrofit.skipping.policies import GatePolicy

    class CountingGates(GatePolicy):
        def __init__(self, **settings):
            super().__init__(**settings)
            self.counts = {"image": [0, 0], "text": [0, 0]}  # skipped, decided

        def skip_mask(self, block, state, adapter):
            skip = super().skip_mask(block, state, adapter)
            image = state.token_is_image  # None in a batch without images
            image = torch.zeros_like(skip) if image is None else image
            for name, where in (("image", image), ("text", ~image)):
                where = where & state.token_is_real
                self.counts[name][0] += int(skip[where].sum())
                self.counts[name][1] += int(where.sum())
            return skip

    model, processor, adapter = _model("qwen2_vl", layers=8, skip_gate=True)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for gate in adapter.gates.values():
            gate.query.copy_(torch.randn(gate.query.shape, generator=generator))
    batches = [tiny_inputs(processor, batch=2), tiny_inputs(processor, batch=2, with_image=False)]
    rates = {}
    for per_modality in (True, False):
        result = calibrate(adapter, batches, 0.25, "gate", per_modality=per_modality, store=False, tolerance=0.02)
        assert ("image_threshold" in result.settings) == per_modality
        policy = CountingGates(**result.settings)
        with torch.no_grad(), adapter.skipping(policy):
            for batch in batches:
                model(**batch)
        assert policy.counts["image"][1] > 0 and policy.counts["text"][1] > 0
        rates[per_modality] = {name: skipped / decided for name, (skipped, decided) in policy.counts.items()}
    assert abs(rates[True]["image"] - rates[True]["text"]) <= 0.03, rates
    assert abs(rates[False]["image"] - rates[False]["text"]) > 0.06, rates  # pooled: the modalities differ here


@pytest.mark.parametrize("policy", ["recent_weight", "gate", "random"])
def test_calibration_restricted_to_candidate_blocks_skips_only_those(policy):
    # Per-token policies spread over every skippable block skip the costly ones as often as the cheap ones;
    # restricted to candidates, the other blocks always run and their layers are not even patched.
    from vlm_retrofit.skipping import POLICIES, SkipController, candidate_blocks, removal_impact

    model, processor, adapter, batches = _routed_with_gates()
    impact = removal_impact(adapter, batches)
    cheapest = sorted(impact, key=impact.__getitem__)[:3]
    assert candidate_blocks(adapter, batches, 3) == tuple(sorted(cheapest))  # no order given: by removal impact
    assert candidate_blocks(adapter, batches, 2, order=[6, 5, 4]) == (5, 6)
    result = calibrate(adapter, batches, 0.2, policy, store=False, candidates=3, tolerance=0.03)
    assert abs(result.achieved_saving - 0.2) <= 0.03, result.summary()
    policy_object = POLICIES[policy](**result.settings)
    assert policy_object.may_skip(adapter.layout) == tuple(sorted(cheapest))
    controller = SkipController(adapter, policy_object)
    assert controller.patched_blocks == tuple(sorted(cheapest))
    with torch.no_grad(), controller as report:
        for batch in batches:
            model(**batch)
    rates = report.skip_rates
    assert all(rates[b] == 0 for b in range(8) if b not in cheapest), rates
    assert all(rates[b] > 0 for b in cheapest), rates
    # 3 of 8 single-layer blocks reach at most 3/8 of the executions; more is refused, as are unknown blocks.
    with pytest.raises(ValueError, match=r"target_saving must be in \(0, 0.375\]"):
        calibrate(adapter, batches, 0.4, policy, store=False, candidates=3)
    with pytest.raises(ValueError, match="candidates"):
        calibrate(adapter, batches, 0.2, policy, store=False, candidates=[0, 3])
    with pytest.raises(ValueError, match="candidates must be a count"):
        calibrate(adapter, batches, 0.2, policy, store=False, candidates=9)


def test_a_candidate_count_takes_the_blocks_skipping_was_trained_on_first():
    # Gates trained on a few blocks only never learned to skip the others: a count ranks the trained ones first
    # (cheapest first among them), then the rest of the order.
    from vlm_retrofit.skipping import candidate_blocks

    model, processor, adapter, batches = _routed_with_gates()
    order = [6, 5, 4, 3, 2, 1]
    assert candidate_blocks(adapter, batches, 2, order=order) == (5, 6)
    adapter.skip_candidates = [1, 3, 4]
    assert candidate_blocks(adapter, batches, 2, order=order) == (3, 4)
    assert candidate_blocks(adapter, batches, 3, order=order) == (1, 3, 4)
    assert candidate_blocks(adapter, batches, 4, order=order) == (1, 3, 4, 6)
    result = calibrate(adapter, batches, 0.2, "gate", store=False, candidates=2, order=order, tolerance=0.03)
    assert set(result.settings["threshold"]) == {3, 4} and result.skip_rates[1] == 0 < result.skip_rates[3], result.skip_rates


@pytest.mark.parametrize("policy", ["recent_weight", "gate", "random"])
def test_calibration_can_keep_image_positions_from_skipping(policy):
    # A batch-1 prefill saves nothing where some prompt token runs a block, so skipping image positions saves next
    # to nothing while every caption token reads them: kept out, they run every block and the target counts text.
    from vlm_retrofit.skipping import POLICIES

    model, processor, adapter, batches = _routed_with_gates()
    result = calibrate(adapter, batches, 0.25, policy, store=False, tolerance=0.03, skip_image_positions=False)
    assert result.settings["skip_image_positions"] is False
    assert not {"image_threshold", "image_thresholds"} & set(result.settings)
    with torch.no_grad(), adapter.skipping(POLICIES[policy](**result.settings)) as report:
        for batch in batches:
            model(**batch)
    assert report.skipped_text_layer_fraction == pytest.approx(result.achieved_saving, abs=1e-6)
    assert abs(result.achieved_saving - 0.25) <= 0.03, result.summary()
    assert result.skip_rates == pytest.approx(report.text_skip_rates)  # per block, counted where the target is
    assert report._layer_weighted(result.skip_rates) == pytest.approx(result.achieved_saving)
    image_decided = [t - text for t, text in zip(report.block_tokens, report.block_text_tokens)]
    image_skipped = [s - text for s, text in zip(report.block_skipped_tokens, report.block_text_skipped_tokens)]
    assert all(image_decided[b] > 0 for b in adapter.layout.skippable_blocks) and image_skipped == [0] * 8
    assert report.skipped_layer_fraction < report.skipped_text_layer_fraction  # counted with image positions
    with pytest.raises(ValueError, match="whole blocks"):
        calibrate(adapter, batches, 0.25, "static", store=False, skip_image_positions=False)


@pytest.mark.parametrize("policy", ["recent_weight", "gate"])
def test_calibration_can_count_the_answer_tokens_only(policy):
    # What a decode step runs is the answer: counted on every text position, a prompt can take the skipping.
    from vlm_retrofit.skipping import POLICIES

    model, processor, adapter, batches = _routed_with_gates()
    answers = []
    for batch in batches:
        mask = batch["attention_mask"].bool().clone()
        mask[:, : mask.shape[1] // 2] = False  # the last half of each row is its answer
        answers.append({**batch, "loss_mask": mask})
    result = calibrate(adapter, answers, 0.25, policy, store=False, tolerance=0.03, skip_image_positions=False,
                       counted_on="response")
    assert result.counted_on == "answer positions" and abs(result.achieved_saving - 0.25) <= 0.03, result.summary()
    skipped = {}

    class Recorded(POLICIES[policy]):
        def skip_mask(self, block, state, adapter):
            skip = super().skip_mask(block, state, adapter)
            skipped[block] = skipped.get(block, 0) + int((skip & answer).sum())
            return skip

    with torch.no_grad(), adapter.skipping(Recorded(**result.settings)):
        for answer, batch in ((b["loss_mask"], b) for b in answers):
            model(**{k: v for k, v in batch.items() if k != "loss_mask"})
    tokens = sum(int(b["loss_mask"].sum()) for b in answers)
    assert sum(skipped.values()) / (tokens * adapter.layout.num_layers) == pytest.approx(result.achieved_saving)
    text = calibrate(adapter, batches, 0.25, policy, store=False, tolerance=0.03, skip_image_positions=False)
    assert text.settings != result.settings
    # An adapter trained with its compute counted on the answer tokens is calibrated there by default.
    adapter.compute_counted_on = "response"
    assert calibrate(adapter, answers, 0.25, policy, store=False, tolerance=0.03,
                     skip_image_positions=False).settings == result.settings
    with pytest.raises(ValueError, match="needs a `loss_mask`"):
        calibrate(adapter, batches, 0.25, policy, store=False)
    with pytest.raises(ValueError, match="counted_on='text' with skip_image_positions=True"):
        calibrate(adapter, batches, 0.25, policy, store=False, counted_on="text", skip_image_positions=True)
    adapter.compute_counted_on = "text"


def test_random_skipping_decides_every_occurrence_of_a_token_on_its_own():
    # The hash takes the position as well as the token: a text repeating one token still skips at the rate,
    # not all or nothing per block, and with another seed it skips elsewhere.
    model, processor, adapter = _model(layers=6)
    input_ids = torch.full((1, 400), 7)
    masks = {}
    for seed in (1, 2):
        policy = RandomPolicy(rate=0.3, seed=seed)
        with torch.no_grad(), adapter.skipping(policy) as report:
            model(input_ids=input_ids)
            masks[seed] = policy.skip_mask(2, adapter._state, adapter)
        assert all(0.22 < report.skip_rates[b] < 0.38 for b in adapter.layout.skippable_blocks), report.skip_rates
    assert 0.3 < (masks[1] != masks[2]).float().mean() < 0.55


@pytest.mark.parametrize("family", ["llama", "qwen2_vl", "idefics3"])
def test_random_skipping_generates_a_row_alike_alone_and_left_padded_in_a_batch(family):
    # Before: the hash took the position counted with the padding (and image features' low bits, which a batched
    # vision tower moves), so a row's decisions, and its answer, changed with what it was batched with.
    model, processor, adapter = _model(family, layers=6)
    batch, alone = tiny_inputs(processor, batch=2), tiny_inputs(processor, batch=1)
    real = batch["attention_mask"][0].bool()
    assert not real.all() and torch.equal(batch["input_ids"][0, real], alone["input_ids"][0])  # row 0, left-padded
    generated = []
    for inputs in (batch, alone):
        with torch.no_grad(), adapter.skipping("random", rate=0.4) as report:
            out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        generated.append(out[0, inputs["input_ids"].shape[1]:])
        assert 0.2 < report.skipped_text_layer_fraction < 0.6
    assert torch.equal(generated[0], generated[1])


def test_random_skipping_decides_each_block_by_its_own_hash():
    """Every block's decisions, computed together once per forward, are the per-block hash of the token's hash
    (the recorded random baselines depend on them)."""
    model, processor, adapter = _model(layers=6)
    policy = RandomPolicy(rate=0.4, seed=3)
    with torch.no_grad(), adapter.skipping(policy):
        model(input_ids=torch.randint(3, 200, (2, 50), generator=torch.Generator().manual_seed(0)))
        token_hash = policy._token_hash(adapter._state)
        for block in adapter.layout.skippable_blocks:
            mixed = RandomPolicy._mix((token_hash + (block + 1) * 0x632BE5AB) & RandomPolicy._MASK)
            expected = mixed.double() / (RandomPolicy._MASK + 1) < 0.4
            assert torch.equal(policy.skip_mask(block, adapter._state, adapter), expected)
            assert 0.2 < expected.float().mean() < 0.6


def test_generated_tokens_count_generation_steps_not_teacher_forced_forwards():
    model, processor, adapter = _model("qwen2_vl")
    inputs = tiny_inputs(processor, batch=2)
    with torch.no_grad(), adapter.skipping(StaticPolicy(blocks=[2])) as report:
        model(**inputs)  # teacher-forced: scores every position, generates nothing
        assert report.generated_tokens == 0 and report.prefill.forwards == 1
        out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape[1] - inputs["input_ids"].shape[1] == 5
    assert report.generated_tokens == 2 * 5  # one token per row per generate forward (prefill + 4 decode steps)
    assert report.tokens_per_second == report.generated_tokens / report.wall_seconds


def test_skip_report_counts_text_positions_apart():
    model, processor, adapter = _model("qwen2_vl", layers=6)
    image_only = PatternPolicy(lambda block, state: state.token_is_image if block == 2 else None)
    with torch.no_grad(), adapter.skipping(image_only) as report:
        model(**tiny_inputs(processor, batch=2))
    assert report.skip_rates[2] > 0 and report.skipped_layer_fraction > 0
    assert report.skipped_text_layer_fraction == 0 and report.as_dict()["skipped_text_layer_fraction"] == 0
    with torch.no_grad(), adapter.skipping(PatternPolicy(_skip_everything)) as text_report:
        model(**tiny_inputs(processor, batch=2, with_image=False))
    assert text_report.skipped_text_layer_fraction == text_report.skipped_layer_fraction > 0
    merged = type(report).merged([report, text_report])
    assert merged.block_text_tokens == [a + b for a, b in zip(report.block_text_tokens, text_report.block_text_tokens)]
    assert merged.block_text_skipped_tokens == text_report.block_text_skipped_tokens


def test_image_settings_contradicting_kept_image_positions_are_refused():
    from vlm_retrofit.skipping.policies import GatePolicy, RecentWeightPolicy

    with pytest.raises(ValueError, match="image_threshold are set while skip_image_positions=False"):
        GatePolicy(0.5, image_threshold=0.4, skip_image_positions=False)
    with pytest.raises(ValueError, match="image_thresholds are set"):
        RecentWeightPolicy(0.5, image_thresholds={1: 0.4}, skip_image_positions=False)


def test_calibration_refuses_unreachable_targets():
    model, processor, adapter = _model(layers=4)  # 2 of 4 layers skippable
    with pytest.raises(ValueError, match=r"target_saving must be in \(0, 0.500\]"):
        calibrate(adapter, [tiny_inputs(processor)], target_saving=0.6)


def test_routing_with_dropped_sources_under_inference_mode_then_training_backpropagates():
    # Lightning validates under inference_mode; a later training step with the same removed blocks must still
    # be able to save its (cached) slot index for backward.
    from vlm_retrofit.routing.stream import _index_tensor

    _index_tensor.cache_clear()
    model, processor, adapter = _model()
    inputs = tiny_inputs(processor)
    with torch.inference_mode(), SkipSimulation(adapter, removed_blocks=[2]):
        model(**inputs)
    with SkipSimulation(adapter, removed_blocks=[2]):
        loss = model(**inputs).logits.float().pow(2).mean()
    loss.backward()
    assert adapter.routers["3"].bias.grad is not None and adapter.routers["3"].bias.grad[3] == 0  # block 2's slot


def test_a_cache_filled_under_static_removal_is_refused_elsewhere_and_continues_under_the_same_removal():
    model, processor, adapter = _model()
    inputs = tiny_inputs(processor)
    with torch.no_grad():
        with adapter.skipping(StaticPolicy(blocks=[2])):
            first = model(**inputs, use_cache=True)
        cache = first.past_key_values
        assert not cache.layers[2].is_initialized  # removed: nothing was written
        step = {"input_ids": first.logits[:, -1:].argmax(-1), "cache": cache, "use_cache": True,
                "attention_mask": torch.cat([inputs["attention_mask"], torch.ones_like(inputs["attention_mask"][:, :1])], 1)}
        for context in (adapter.disabled, lambda: adapter.skipping(StaticPolicy(blocks=[1])), torch.no_grad):
            with context(), pytest.raises(RuntimeError, match=r"static removal of layers \[2\].*new cache"):
                model(**step)
        with adapter.skipping(StaticPolicy(blocks=[2, 3])) as report:  # a superset: layer 2 stays removed
            model(**step)
        assert report.decode.forwards == 1 and report.prefill.forwards == 0
        adapter.detach()  # the plain model: nothing checks the cache before the layers run ...
        with pytest.raises(RuntimeError, match=r"layer 2 of this KV cache holds no K/V.*new cache"):
            model(**step)  # ... but the emptied layer refuses to be written
        assert not cache.layers[2].is_initialized
        fresh = DynamicCache(config=model.config)
        model(**{**step, "input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "cache": fresh})
        assert fresh.layers[2].is_initialized  # other caches are untouched


def test_accounting_reads_the_context_length_when_the_decoder_is_called_directly():
    model, processor, adapter = _model()
    decoder = model.model  # LlamaModel: the causal-LM top (and its input capture) is bypassed
    with torch.no_grad(), adapter.skipping(StaticPolicy(blocks=[1, 2])) as report:
        cache = DynamicCache(config=model.config)
        decoder(input_ids=torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
        decoder(input_ids=torch.tensor([[8]]), cache=cache, use_cache=True)
    assert (report.prefill.forwards, report.decode.forwards) == (1, 1)
    assert report.prefill.tokens == 3 and report.decode.tokens == 1


def test_block_influence_averages_over_real_tokens_only():
    model, processor, adapter = _model()
    batch = dict(tiny_inputs(processor, batch=1))
    padded = dict(batch)  # the same row with right padding: its real tokens compute exactly as before
    pad = torch.full_like(batch["input_ids"][:, :5], processor.pad_token_id)
    padded["input_ids"] = torch.cat([batch["input_ids"], pad], dim=1)
    padded["attention_mask"] = torch.cat([batch["attention_mask"], torch.zeros_like(batch["attention_mask"][:, :5])], dim=1)
    alone, with_padding = block_influence(adapter, [batch]), block_influence(adapter, [padded])
    assert alone.keys() == with_padding.keys() and all(v > 0 for v in alone.values())
    for block, value in alone.items():
        assert with_padding[block] == pytest.approx(value, rel=1e-4), block
