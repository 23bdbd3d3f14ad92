"""Linear replacement of removed layers: the fit beats plain removal on its data, hooks equal folded weights,
refusals (layer 0, Gemma's normed MLP output, a replacement fitted for other layers)."""

import json

import pytest
import torch

from vlm_retrofit.backbones import resolve, spec_for
from vlm_retrofit.pruning import layers_removed
from vlm_retrofit.replacement import (check_replacements, fit_replacements, fold_replacements, removed_spans,
                                      replaced_layers, replacements_applied, replacements_folded)
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm

# Families whose MLP adds one linear layer's output to the stream (not a normed output, not experts).
FOLDABLE = [f for f in FAMILIES if spec_for(f).mlp_output_attr is not None]
REMOVED = [2, 4, 5]  # two spans in a 7-layer decoder: [2] folded into layer 1, [4, 5] into layer 3


def _calibration(model, processor):
    inputs = tiny_inputs(processor, batch=3)
    return [(dict(inputs), inputs["attention_mask"].bool())]


def _stream_error(model, spec, batches, transforms):
    """Squared distance, at the calibration positions, of the stream after the last replaced span's front layer
    (removed layers and replacements applied) from the full model's stream after that span."""
    layers = spec.get_layers(model)
    captured = {}
    hooks = [layers[6].register_forward_pre_hook(lambda m, args, kwargs: captured.__setitem__("x", args[0] if args else kwargs["hidden_states"]),
                                                 with_kwargs=True)]
    try:
        (inputs, mask), = batches
        with torch.no_grad():
            model(**inputs, use_cache=False)
            full = captured["x"][mask]
            with replacements_applied(model, spec, transforms), layers_removed(model, spec, REMOVED):
                model(**inputs, use_cache=False)
            return float(((captured["x"][mask] - full) ** 2).sum())
    finally:
        for hook in hooks:
            hook.remove()


def test_spans_and_front_layers():
    assert removed_spans([26, 13, 17, 14, 16, 18]) == [[13, 14], [16, 17, 18], [26]]
    assert replaced_layers([26, 13, 17, 14, 16, 18]) == [12, 15, 25]
    assert removed_spans([]) == []
    with pytest.raises(ValueError, match="layer 0 is removed"):
        replaced_layers([0, 1, 5])


@pytest.mark.parametrize("family", FOLDABLE)
def test_fit_beats_plain_removal_and_folds_exactly(family):
    model, processor = tiny_vlm(family, num_hidden_layers=7)
    spec = resolve(model)
    batches = _calibration(model, processor)
    transforms = fit_replacements(model, spec, REMOVED, batches, ridge=1e-6)
    assert sorted(transforms) == [1, 3]
    assert all(t.shape == (64, 64) for t in transforms.values())

    # The least-squares fit can only improve on T = I (plain removal) where it was fitted.
    identity = {i: torch.eye(64) for i in transforms}
    assert _stream_error(model, spec, batches, transforms) < 0.9 * _stream_error(model, spec, batches, identity)

    # Hooks (training) and folded weights (release) compute the same model.
    inputs = batches[0][0]
    mask = inputs["attention_mask"].bool()
    with torch.no_grad(), replacements_applied(model, spec, transforms), layers_removed(model, spec, REMOVED):
        hooked = model(**inputs, use_cache=False).logits[mask]
    with torch.no_grad(), layers_removed(model, spec, REMOVED):
        plain = model(**inputs, use_cache=False).logits[mask]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad(), replacements_folded(model, spec, transforms), layers_removed(model, spec, REMOVED):
        folded_for_now = model(**inputs, use_cache=False).logits[mask]
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # restored exactly
    fold_replacements(model, spec, transforms)
    with torch.no_grad(), layers_removed(model, spec, REMOVED):
        folded = model(**inputs, use_cache=False).logits[mask]
    torch.testing.assert_close(folded, hooked, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(folded_for_now, folded, atol=0, rtol=0)
    assert (folded - plain).abs().max() > 1e-3  # the replacement does change the pruned model


def test_nothing_removed_fits_nothing():
    model, processor = tiny_vlm("llama", num_hidden_layers=7)
    assert fit_replacements(model, resolve(model), [], _calibration(model, processor)) == {}


@pytest.mark.parametrize("family, why", [("gemma3", "normalise their MLP output"),
                                         ("glm4v", r"normalise their MLP output .*\(post_mlp_layernorm\)"),
                                         ("qwen3_vl_moe", "no single linear layer"),  # experts
                                         ("qwen3_5_moe", "no single linear layer")])  # experts and a shared one
def test_unfoldable_families_refused_before_any_work(family, why):
    model, processor = tiny_vlm(family, num_hidden_layers=7)
    with pytest.raises(ValueError, match=why):
        fit_replacements(model, resolve(model), REMOVED, [])


def test_a_layer_with_a_norm_after_its_mlp_is_refused_whatever_its_family_spec_says():
    # PaliGemma 2 shares model_type "paligemma" with PaliGemma 1 but has Gemma 2 text, whose MLP output passes
    # post_feedforward_layernorm: the replacement was fitted and folded silently into the wrong place.
    from torch import nn

    from vlm_retrofit.replacement import output_projection

    model, _ = tiny_vlm("paligemma")
    spec, layer = resolve(model), resolve(model).get_layers(model)[1]
    assert output_projection(spec, layer) is layer.mlp.down_proj
    layer.post_feedforward_layernorm = nn.LayerNorm(model.config.text_config.hidden_size)
    with pytest.raises(ValueError, match=r"normalise their MLP output .*\(post_feedforward_layernorm\)"):
        output_projection(spec, layer)


def test_replacement_for_other_layers_refused():
    transforms = {1: torch.eye(64), 3: torch.eye(64)}
    check_replacements(transforms, REMOVED, REMOVED, hidden_size=64, source="adapter")
    with pytest.raises(ValueError, match=r"fitted with layers \[2, 4, 5\] removed, but layers \[2, 4\]"):
        check_replacements(transforms, [2, 4], REMOVED, hidden_size=64, source="adapter")
    with pytest.raises(ValueError, match="must be 32x32"):
        check_replacements(transforms, REMOVED, REMOVED, hidden_size=32, source="adapter")


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _module(**kwargs):
    from vlm_retrofit.training import RetrofitModule

    args = dict(backbone="tiny:llama", backbone_kwargs={"num_hidden_layers": 6}, lora=LORA, removal_order=[3, 2, 1],
                max_removed_blocks=2, min_removed_blocks=2, max_drop_rate=0.0, use_gates=False, train_routers=False,
                replace_removed=True, replacement_batches=2, lr=1e-2, warmup_steps=0, scheduler="constant")
    return RetrofitModule(**{**args, **kwargs})


def _data(seed):
    from vlm_retrofit.training import FixedBatchDataModule

    data = FixedBatchDataModule(processor="tiny:llama", num_batches=2, val_batches=0, batch_size=2, seed=seed)
    data.setup()
    return data


def _trainer(max_steps, root):
    import lightning.pytorch as pl

    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, default_root_dir=root,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0)


def test_module_fits_the_replacement_trains_with_it_resumes_it_and_ships_it_pruned(tmp_path):
    from vlm_retrofit import load_release
    from vlm_retrofit.release import load_checkpoint, load_trained, merge

    module, data = _module(), _data(seed=0)
    base, _ = tiny_vlm("llama", num_hidden_layers=6)
    expected = fit_replacements(base, resolve(base), [2, 3], [module.model_inputs(b) for b in data.train_batches])

    _trainer(3, tmp_path / "run").fit(module, data)
    assert sorted(module.replacements) == [1]  # span [2, 3] is carried by layer 1
    torch.testing.assert_close(module.replacements[1], expected[1], atol=1e-5, rtol=1e-4)  # fitted on the base

    # The student runs with it: identity transforms are plain removal, the fitted ones are not.
    batch = data.train_batches[0]
    fitted = module.replacements

    def kl(replacements):
        module.replacements = replacements
        with torch.no_grad():
            return module.compute_loss(batch, drop_rate=0.0, seed=0).kl

    plain = kl(None)
    torch.testing.assert_close(kl({1: torch.eye(64)}), plain)
    assert abs(kl(fitted) - plain) > 1e-4
    module.replacements = fitted

    # A resumed run keeps the checkpoint's replacement, even on other data (a refit would differ).
    (ckpt,) = (tmp_path / "run").rglob("*.ckpt")
    resumed = _module()
    _trainer(4, tmp_path / "resumed").fit(resumed, _data(seed=1), ckpt_path=str(ckpt))
    torch.testing.assert_close(resumed.replacements[1], fitted[1])

    # The adapter folder and the checkpoint both carry it; a pruned release folds it into layer 1.
    module.save_adapter(tmp_path / "adapter")
    transforms, layers = load_trained(tmp_path / "adapter").replacement
    assert layers == [2, 3] and torch.equal(transforms[1], fitted[1].cpu())
    merge(ckpt, tmp_path / "pruned", prune_blocks=[2, 3])
    config = json.loads((tmp_path / "pruned" / "release_config.json").read_text())
    assert config["pruned"]["replacement_folded_into"] == [1]
    assert "folded into the MLP output projections of layers [1]" in (tmp_path / "pruned" / "README.md").read_text()
    released, processor = load_release(tmp_path / "pruned")
    reference = load_checkpoint(ckpt)
    reference.adapter.detach()
    model = reference.model.merge_and_unload()
    inputs = tiny_inputs(processor)
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        with replacements_applied(model, resolve(model), reference.replacement[0]), layers_removed(model, resolve(model), [2, 3]):
            student = model(**inputs).logits[mask]
        torch.testing.assert_close(released(**inputs).logits[mask], student, atol=1e-4, rtol=0)

    # Refused before any work: other layers pruned, or a release that would silently drop it.
    with pytest.raises(ValueError, match="not what this adapter was trained for"):
        merge(ckpt, tmp_path / "other", prune_blocks=[3])
    with pytest.raises(ValueError, match=r"fitted with layers \[2, 3\] removed, but layers \[3\]"):
        merge(ckpt, tmp_path / "other", prune_blocks=[3], allow_untrained_removal=True)
    with pytest.raises(ValueError, match="only a pruned release can use"):
        merge(ckpt, tmp_path / "routers")
    assert not (tmp_path / "other").exists() and not (tmp_path / "routers").exists()


def test_module_refuses_a_replacement_it_cannot_keep():
    with pytest.raises(ValueError, match="min_removed_blocks == max_removed_blocks"):
        _module(min_removed_blocks=1)
    with pytest.raises(ValueError, match="train_routers: false"):
        _module(train_routers=True)
    with pytest.raises(ValueError, match="normalise their MLP output"):
        _module(backbone="tiny:gemma3")
