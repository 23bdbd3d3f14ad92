"""Stand-ins for skipped layers: zero at init, what a skipping token gets in every skip path, cache consistency,
the training simulation, FLOP accounting, the least-squares fit and the save/load round trip."""

import pytest
import torch
from transformers import DynamicCache

from vlm_retrofit import RouterAdapter, RouterConfig, attach_routers
from vlm_retrofit.routing import check_identity, fit_stand_ins, rms_normalize
from vlm_retrofit.skipping import LayerCost, PatternPolicy, RandomPolicy, SkipSimulation, StaticPolicy
from vlm_retrofit.testing import tiny_inputs, tiny_vlm

NEW_TOKENS = 6


def _random_stand_ins(adapter, scale=0.3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stand_in in adapter.stand_ins.values():
            stand_in.weight.copy_(scale * torch.randn(stand_in.weight.shape, generator=generator))
            stand_in.bias.copy_(scale * torch.randn(stand_in.bias.shape, generator=generator))


def _model(family="llama", layers=6, trained_like=True, **config):
    model, processor = tiny_vlm(family, num_hidden_layers=layers)
    adapter = attach_routers(model, RouterConfig(skip_stand_in=True, **config))
    if trained_like:
        _random_stand_ins(adapter)
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for router in adapter.routers.values():
                router.query.copy_(0.5 * torch.randn(router.query.shape, generator=generator))
    return model, processor, adapter


def _stand_in_output(adapter, layer, hidden):
    """What the stand-in math says a skipping token gets: `h + RMSNorm(h) W + b`."""
    stand_in = adapter.stand_ins[str(layer)]
    return hidden + rms_normalize(hidden, adapter.config.key_norm_eps) @ stand_in.weight + stand_in.bias


def test_stand_ins_exist_for_the_skippable_layers_only_and_start_at_zero():
    model, _, adapter = _model(layers=6, trained_like=False, block_size=2)
    # Blocks 0..2 of 2 layers; 0 and 2 never skip by default: block 1 (layers 2, 3) is the only skippable one.
    assert sorted(map(int, adapter.stand_ins)) == [2, 3]
    assert all(not s.weight.any() and not s.bias.any() for s in adapter.stand_ins.values())
    assert len(attach_routers(tiny_vlm("llama")[0], RouterConfig()).stand_ins) == 0


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_identity_at_init_with_stand_ins(family):
    model, processor = tiny_vlm(family)
    assert check_identity(model, tiny_inputs(processor, batch=2), RouterConfig(skip_stand_in=True)) <= 1e-4


def test_zero_stand_ins_at_uniform_routing_skip_as_plain_layer_dropping():
    """At init a stand-in adds nothing and its (zero) delta is a present source at uniform routing: the same
    function as dropping the layer, as without stand-ins."""
    model, processor, adapter = _model("qwen2_vl", trained_like=False)
    inputs = tiny_inputs(processor)
    policy = PatternPolicy(lambda block, state: (torch.arange(state.routed_input.shape[1]) % 2 == 0)
                           .expand(state.routed_input.shape[:-1]) if block in (2, 3) else None)
    with torch.no_grad(), adapter.skipping(policy):
        with_stand_ins = model(**inputs).logits
    adapter.detach()
    plain = attach_routers(model, RouterConfig())
    with torch.no_grad(), plain.skipping(policy):
        without = model(**inputs).logits
    torch.testing.assert_close(with_stand_ins, without, atol=1e-5, rtol=0)


def test_a_removed_block_runs_its_stand_ins_in_place_of_its_layers():
    """Static removal at uniform routing with stand-ins = the plain model with those layers replaced by their
    stand-ins (the delta stays in the stream, the cache stays unwritten)."""
    model, processor, adapter = _model("qwen2_vl")
    with torch.no_grad():
        for router in adapter.routers.values():
            router.query.zero_()  # uniform routing: the retrofit is the plain residual stream
    inputs = tiny_inputs(processor)
    with torch.no_grad(), adapter.skipping(StaticPolicy(blocks=[2, 3])):
        skipped = model(**inputs).logits
    layers = model.get_decoder().layers
    handles = [layers[i].register_forward_hook(
        lambda m, args, kwargs, out, i=i: _stand_in_output(adapter, i, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for i in (2, 3)]
    try:
        with torch.no_grad(), adapter.disabled():
            replaced = model(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(skipped, replaced, atol=1e-4, rtol=0)
    # Without stand-ins the same removal is another function: they did something.
    assert (skipped - model(**inputs).logits).abs().max() > 1e-3


def test_a_skipped_blocks_delta_stays_present_with_stand_ins():
    model, processor, adapter = _model()
    first_token_skips_block_2 = PatternPolicy(
        lambda block, state: (torch.arange(state.routed_input.shape[1]) == 0).expand(state.routed_input.shape[:-1])
        if block == 2 else None)
    with torch.no_grad(), adapter.skipping(first_token_skips_block_2):
        model(**tiny_inputs(processor))
    alpha = adapter.last_routing_weights["3"]  # sources s0, then the deltas of blocks 0, 1, 2
    assert torch.all(alpha[3] > 0), "the stand-in's delta of the skipped block takes no routing weight"


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen2_vl", "gemma3"])
def test_cached_skipping_with_stand_ins_equals_the_uncached_reference(family, batch):
    """Invariant 2 with stand-ins: the kv-only, mixed and reference paths all give a skipping token its stand-in."""
    model, processor, adapter = _model(family)
    inputs = tiny_inputs(processor, batch=batch)
    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                   return_dict_in_generate=True,
                   suppress_tokens=sorted(adapter.spec.image_token_ids(model.config)))
    policy = RandomPolicy(rate=0.45, seed=3)
    with torch.no_grad():
        with adapter.skipping(policy) as report:
            cached = model.generate(**inputs, **options)
        whole = adapter.skipping(policy)
        whole.kv_only_when_all_skip = False  # fully skipped steps run the layer and select
        with whole:
            through_layers = model.generate(**inputs, **options)
        dense = adapter.skipping(policy)
        dense.sparse_mlp = False  # mixed blocks run their MLP and stand-ins over every token
        with dense:
            dense_rows = model.generate(**inputs, **options)
        with adapter.skipping(policy):
            reference = model.generate(**inputs, use_cache=False, **options)
    for other in (through_layers, dense_rows, reference):
        assert torch.equal(cached.sequences, other.sequences)
        torch.testing.assert_close(torch.stack(cached.logits, 1), torch.stack(other.logits, 1), atol=1e-4, rtol=0)
    assert report.layer_calls["mixed"] > 0
    if batch == 1:
        assert report.layer_calls["kv_only"] > 0
    # The stand-ins changed what skipping computes.
    adapter_without = {k: v.clone() for k, v in adapter.stand_ins.state_dict().items()}
    with torch.no_grad():
        for stand_in in adapter.stand_ins.values():
            stand_in.weight.zero_()
            stand_in.bias.zero_()
        with adapter.skipping(policy):
            zeroed = model.generate(**inputs, **options)
    adapter.stand_ins.load_state_dict(adapter_without)
    assert (torch.stack(cached.logits, 1) - torch.stack(zeroed.logits, 1)).abs().max() > 1e-3


def test_simulation_with_stand_ins_is_the_inference_function_and_trains_them():
    model, processor, adapter = _model(skip_gate=True)
    inputs = tiny_inputs(processor)
    simulation = SkipSimulation(adapter, drop_rate=0.4, use_gates=True, generator=torch.Generator().manual_seed(0),
                                removed_blocks=[4])
    with simulation:
        simulated = model(**inputs).logits
        masks = {block: simulation._skip[block] for block in adapter.layout.skippable_blocks}
    assert any(m.any() for m in masks.values()) and not all(m.all() for m in masks.values())
    with torch.no_grad(), adapter.skipping(PatternPolicy(lambda block, state: masks.get(block))):
        replayed = model(**inputs).logits
    torch.testing.assert_close(simulated.detach(), replayed, atol=1e-4, rtol=0)
    simulated.float().pow(2).mean().backward()
    for layer in adapter.layout.layers_of_blocks(adapter.layout.skippable_blocks):
        assert adapter.stand_ins[str(layer)].weight.grad.abs().sum() > 0, layer


def test_the_simulated_compute_counts_what_a_skipping_token_still_runs():
    # llama tiny: d=64, 6 layers, blocks 1-4 skippable; block 4 removed, blocks 1-3 sampled at drop rate 0.5.
    model, processor, adapter = _model()
    simulation = SkipSimulation(adapter, drop_rate=0.5, use_gates=False, generator=torch.Generator().manual_seed(0),
                                removed_blocks=[4])
    with torch.no_grad(), simulation:
        model(**tiny_inputs(processor))
    cost = LayerCost.from_config(model.config)
    stand_in = 2 * 64 * 64 / cost.dense  # the stand-in's product against the layer's
    sampled = stand_in + cost.kv_projection / cost.dense  # a per-token skip also writes its K/V at decode
    assert simulation.skipped_cost == pytest.approx({1: sampled, 2: sampled, 3: sampled, 4: stand_in})
    # Layers 0 and 5 run; a skipped layer costs its share, block 4's stand-in runs for every token.
    assert simulation.expected_compute().item() == pytest.approx((2 + 3 * (0.5 + 0.5 * sampled) + stand_in) / 6)
    realised = simulation.realised_keep
    assert 0 < realised[1] < 1 and realised[4] == 0.0
    assert simulation.realised_compute() == pytest.approx(
        (2 + sum(realised[b] + (1 - realised[b]) * sampled for b in range(1, 4)) + stand_in) / 6)


def test_accounting_counts_the_stand_ins_products():
    # llama tiny: d=64; 4 layers, block 2 skipped by every token (kv-only), as test_skipping's hand-computed case.
    model, _, adapter = _model(layers=4)
    cost = LayerCost.from_config(model.config)
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    per_layer_prefill = 5 * cost.dense + 4 * 64 * (5 * 6 // 2)
    per_layer_decode = cost.dense + 4 * 64 * 6
    stand_in = 2 * 64 * 64
    everyone_skips_2 = PatternPolicy(lambda block, state: torch.ones(state.routed_input.shape[:-1], dtype=torch.bool)
                                     if block == 2 else None)
    with torch.no_grad(), adapter.skipping(everyone_skips_2) as report:
        cache = DynamicCache(config=model.config)
        model(input_ids=input_ids, cache=cache, use_cache=True)
        model(input_ids=torch.tensor([[10]]), cache=cache, use_cache=True)
    assert report.prefill.executed_flops == 3 * per_layer_prefill + 5 * (cost.kv_projection + stand_in)
    assert report.decode.executed_flops == 3 * per_layer_decode + cost.kv_projection + stand_in
    with torch.no_grad(), adapter.skipping(StaticPolicy(blocks=[2])) as removed:
        model(input_ids=input_ids)
    assert removed.prefill.executed_flops == 3 * per_layer_prefill + 5 * stand_in
    # A mixed block computes the stand-ins at its skipping tokens only (2 of 5 here), beside the layer run whole
    # (the sparse MLP spares their MLP rows).
    two_skip = PatternPolicy(lambda block, state: (torch.arange(5) < 2)[None] if block == 2 else None)
    with torch.no_grad(), adapter.skipping(two_skip) as mixed:
        model(input_ids=input_ids)
    mlp = 3 * 2 * 64 * 128
    assert mixed.layer_calls["mixed"] == 1
    assert mixed.prefill.executed_flops == 4 * per_layer_prefill - 2 * mlp + 2 * stand_in


def test_fit_is_the_least_squares_map_and_brings_skipping_nearer_the_base():
    model, processor, adapter = _model("qwen2_vl", trained_like=False)
    batches = [tiny_inputs(processor, batch=2)]
    layers = model.get_decoder().layers
    captured = {}

    def capture(module, args, kwargs, out, index):
        captured[index] = (args[0] if args else kwargs["hidden_states"], out[0] if isinstance(out, tuple) else out)

    handles = [layers[i].register_forward_hook(lambda *a, i=i: capture(*a, i), with_kwargs=True) for i in (2, 3)]
    with torch.no_grad(), adapter.disabled():
        base = model(**batches[0]).logits
    for handle in handles:
        handle.remove()
    explained = fit_stand_ins(adapter, batches, ridge=1e-6)
    assert set(explained) == {1, 2, 3, 4} and all(0 < r2 <= 1 for r2 in explained.values())
    # Layer 2 against the ridge solution written out, over the real tokens of the full model's stream.
    hidden, out = captured[2]
    real = batches[0]["attention_mask"].bool()
    assert not real.all()  # a padded batch: the padding must be left out
    x = torch.cat([rms_normalize(hidden, 1e-6)[real], torch.ones(int(real.sum()), 1)], 1).double()
    y = (out - hidden)[real].double()
    normal = x.T @ x
    solution = torch.linalg.solve(normal + 1e-6 * normal.diagonal().mean() * torch.eye(len(normal)), x.T @ y)
    stand_in = adapter.stand_ins["2"]
    torch.testing.assert_close(torch.cat([stand_in.weight, stand_in.bias[None]]).double(), solution,
                               atol=1e-4 * float(solution.abs().max()), rtol=0)
    fitted = x @ solution
    residual = 1 - float((fitted - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    assert explained[2] == pytest.approx(residual, abs=1e-4)

    def kl_to_base(policy):
        with torch.no_grad(), adapter.skipping(policy):
            logits = model(**batches[0]).logits
        return torch.nn.functional.kl_div(logits.log_softmax(-1), base.log_softmax(-1), log_target=True,
                                          reduction="batchmean").item()

    fitted_kl = kl_to_base(StaticPolicy(blocks=[2, 3]))
    for stand_in in adapter.stand_ins.values():
        torch.nn.init.zeros_(stand_in.weight)
        torch.nn.init.zeros_(stand_in.bias)
    assert fitted_kl < kl_to_base(StaticPolicy(blocks=[2, 3]))


def test_fit_refuses_layers_without_a_stand_in_and_batches_without_tokens():
    model, processor, adapter = _model(trained_like=False)
    with pytest.raises(ValueError, match="no stand-in"):
        fit_stand_ins(adapter, [tiny_inputs(processor)], layers=[0])
    with pytest.raises(ValueError, match="no real token"):
        fit_stand_ins(adapter, [])


def test_stand_ins_survive_a_save_load_round_trip(tmp_path):
    model, processor, adapter = _model()
    inputs = tiny_inputs(processor)
    policy = StaticPolicy(blocks=[2, 3])
    with torch.no_grad(), adapter.skipping(policy):
        before = model(**inputs).logits
    adapter.save_pretrained(tmp_path)
    adapter.detach()
    loaded = RouterAdapter.from_pretrained(model, tmp_path)
    assert loaded.config.skip_stand_in
    with torch.no_grad(), loaded.skipping(policy):
        after = model(**inputs).logits
    torch.testing.assert_close(before, after, atol=0, rtol=0)


def test_a_pruned_release_refuses_blocks_whose_stand_ins_hold_a_fit():
    from vlm_retrofit.errors import InputError
    from vlm_retrofit.pruning import blocks_to_prune

    _, _, fitted = _model()
    with pytest.raises(InputError, match="stand-ins"):
        blocks_to_prune(fitted, blocks=[2], allow_untrained=True)
    _, _, zero = _model(trained_like=False)  # nothing to lose: an identity skip
    assert blocks_to_prune(zero, blocks=[2], allow_untrained=True) == [2]


# --------------------------------------------------------------------------- training
def _trainer(max_steps):
    import lightning.pytorch as pl

    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0)


@pytest.mark.parametrize("lr_scale", [0.0, 0.5])
def test_training_fits_the_stand_ins_first_then_trains_them_at_their_rate(lr_scale, monkeypatch):
    from vlm_retrofit.training import FixedBatchDataModule, RetrofitModule

    module = RetrofitModule(backbone="tiny:qwen2_vl", router={"skip_stand_in": True}, max_drop_rate=0.5,
                            drop_warmup_steps=0, lr=1e-2, warmup_steps=1, stand_in_batches=2,
                            stand_in_lr_scale=lr_scale)
    groups = {g.get("name"): g for g in module.configure_optimizers()["optimizer"].param_groups}
    assert groups["stand_ins"]["initial_lr"] == pytest.approx(1e-2 * lr_scale) and groups["stand_ins"]["weight_decay"] == 0
    fits = []
    fit = RetrofitModule.fit_stand_ins

    def recording_fit(self, batches=None):
        explained = fit(self, batches)
        fits.append({k: v.clone() for k, v in self.adapter.stand_ins.state_dict().items()})
        return explained

    monkeypatch.setattr(RetrofitModule, "fit_stand_ins", recording_fit)
    dm = FixedBatchDataModule(processor="tiny:qwen2_vl", num_batches=3, val_batches=0, batch_size=2)
    _trainer(3).fit(module, dm)
    assert len(fits) == 1 and all(v.any() for v in fits[0].values())
    moved = max((module.adapter.stand_ins.state_dict()[k] - v).abs().max().item() for k, v in fits[0].items())
    assert (moved > 0) == (lr_scale > 0)
    # A second fit (a resumed run, an adapter to start from) keeps the fit it holds.
    _trainer(1).fit(module, dm)
    assert len(fits) == 1


def test_stand_in_settings_are_checked():
    from vlm_retrofit.errors import InputError
    from vlm_retrofit.training import RetrofitModule

    for bad in ({"stand_in_batches": 0}, {"stand_in_ridge": 0.0}, {"stand_in_lr_scale": -1.0}):
        with pytest.raises(InputError, match="stand_in"):
            RetrofitModule(backbone="tiny:llama", router={"skip_stand_in": True}, **bad)


def test_a_release_of_routers_with_stand_ins_generates_as_the_trained_model(tmp_path):
    from conftest import fit_config

    from vlm_retrofit import get_adapter, load_release
    from vlm_retrofit.release import load_checkpoint, merge

    fit_config(tmp_path, "tiny-llava-lora.yaml", "--trainer.max_steps", "2", "--model.router.skip_stand_in", "true",
               "--model.stand_in_batches", "1")
    checkpoint = tmp_path / "runs" / "tiny-llava-lora" / "checkpoints" / "last.ckpt"
    source = load_checkpoint(checkpoint)
    assert any(bool(p.any()) for p in source.adapter.stand_ins.parameters())  # fitted, then trained
    inputs = tiny_inputs(source.processor)
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad(), source.adapter.skipping("random", rate=0.5) as report:
        expected = source.model.generate(**inputs, **options)
    assert sum(report.block_skipped_tokens) > 0
    merge(checkpoint, tmp_path / "release")
    model, _ = load_release(tmp_path / "release")
    with torch.no_grad(), get_adapter(model).skipping("random", rate=0.5):
        released = model.generate(**inputs, **options)
    assert torch.equal(released.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(released.logits, 1), torch.stack(expected.logits, 1), atol=1e-5, rtol=0)
