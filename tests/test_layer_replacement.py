"""Layer replacement of removed layers: the fit improves on plain removal for every family, the student's substitute
equals the folded weights, adapter and checkpoint round trips, the pruned release runs the student's model."""

import json
import warnings

import pytest
import torch

from vlm_retrofit.backbones import resolve
from vlm_retrofit.layer_replacement import (fit_layer_replacements, standalone_layer, standalone_shapes,
                                             substitutes)
from vlm_retrofit.pruning import layers_removed
from vlm_retrofit.replacement import (check_replacements, fold_replacements, load_replacements, replacements_folded,
                                      save_replacements)
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm

from test_replacement import _data, _trainer, _module as _healing_module

REMOVED = [2, 4, 5]  # two spans in a 7-layer decoder: [2] carried by layer 1, [4, 5] by layer 3


def _stream_after_span(model, spec, inputs, mask, replaced, removed=REMOVED):
    """The stream entering layer 6 at the `mask` positions: of the full model, and with `removed` removed (their
    front layers running `replaced`'s substitutes)."""
    captured = {}
    layers = spec.get_layers(model)
    hook = layers[6].register_forward_pre_hook(
        lambda m, args, kwargs: captured.__setitem__("x", args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
            full = captured["x"][mask]
            with layers_removed(model, spec, removed, substitutes(model, spec, replaced)):
                model(**inputs, use_cache=False)
            return full, captured["x"][mask]
    finally:
        hook.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_fit_beats_plain_removal_and_folds_exactly(family):
    model, processor = tiny_vlm(family, num_hidden_layers=7)
    spec = resolve(model)
    inputs = dict(tiny_inputs(processor, batch=3))
    mask = inputs["attention_mask"].bool()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    states = fit_layer_replacements(model, spec, REMOVED, [(inputs, mask)], epochs=30, lr=3e-3)
    assert sorted(states) == [1, 3]
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # the backbone is untouched
    own = standalone_layer(spec.get_layers(model)[1]).state_dict()
    assert states[1].keys() == own.keys() and all(v.dtype == torch.float32 for v in states[1].values())

    # Trained where it was fitted, the stream after the spans is closer to the full model's than plain removal's.
    full, plain = _stream_after_span(model, spec, inputs, mask, {})
    _, replaced = _stream_after_span(model, spec, inputs, mask, states)
    assert ((replaced - full) ** 2).sum() < 0.9 * ((plain - full) ** 2).sum()

    # The student's substitutes and the folded weights (a pruned release's) compute the same model.
    with torch.no_grad(), layers_removed(model, spec, REMOVED, substitutes(model, spec, states)):
        student = model(**inputs, use_cache=False).logits[mask]
    with torch.no_grad(), replacements_folded(model, spec, states), layers_removed(model, spec, REMOVED):
        folded_for_now = model(**inputs, use_cache=False).logits[mask]
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # restored exactly
    fold_replacements(model, spec, states)
    with torch.no_grad(), layers_removed(model, spec, REMOVED):
        folded = model(**inputs, use_cache=False).logits[mask]
    torch.testing.assert_close(folded, student, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(folded_for_now, folded, atol=0, rtol=0)


def test_full_span_inputs_take_one_forward_and_fit_later_spans_on_the_full_stream():
    model, processor = tiny_vlm("llama", num_hidden_layers=7)
    spec = resolve(model)
    layers = spec.get_layers(model)
    inputs = dict(tiny_inputs(processor, batch=3))
    batches = [(inputs, inputs["attention_mask"].bool())] * 2
    forwards = []
    handle = layers[0].register_forward_hook(lambda *args: forwards.append(1))
    try:
        replaced = fit_layer_replacements(model, spec, REMOVED, batches, epochs=4, lr=3e-3)
        assert len(forwards) == 2 * len(batches)  # the second span's input: once more with the first replaced
        forwards.clear()
        full = fit_layer_replacements(model, spec, REMOVED, batches, epochs=4, lr=3e-3, span_inputs="full")
        assert len(forwards) == len(batches)  # every span's input and target from one forward
    finally:
        handle.remove()
    # The first span reads the same stream either way; the second one is fitted to another input.
    assert all(torch.equal(full[1][k], v) for k, v in replaced[1].items())
    assert not all(torch.equal(full[3][k], v) for k, v in replaced[3].items())
    # Fitted on the full model's stream, the second replacement alone (layers 4-5 removed, layer 2 kept) brings the
    # stream after it closer to the full model's than removing 4-5 plainly.
    mask = inputs["attention_mask"].bool()
    target, plain = _stream_after_span(model, spec, inputs, mask, {}, removed=[4, 5])
    _, fitted = _stream_after_span(model, spec, inputs, mask, {3: full[3]}, removed=[4, 5])
    assert ((fitted - target) ** 2).sum() < 0.9 * ((plain - target) ** 2).sum()
    with pytest.raises(ValueError, match="span_inputs must be 'replaced' or 'full'"):
        fit_layer_replacements(model, spec, REMOVED, batches, span_inputs="teacher")


def test_a_capture_runs_until_every_layer_it_takes_and_copies_shared_arguments_once():
    from vlm_retrofit.layer_replacement import _captured

    model, processor = tiny_vlm("llama", num_hidden_layers=7)
    spec = resolve(model)
    inputs = dict(tiny_inputs(processor, batch=2))
    ran = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
               for i, layer in enumerate(spec.get_layers(model))]
    try:
        for inputs_of, outputs_of, last in (([5], [2], 4), ([1, 3], [3], 3), ([3], [], 2), ([], [4], 4)):
            ran.clear()
            with torch.no_grad():
                (captured,) = _captured(model, spec, [(inputs, None)], inputs_of=inputs_of, outputs_of=outputs_of)
            assert max(ran) == last  # the forward stopped as soon as it had everything (an input: before that layer)
            assert sorted(captured) == sorted([f"in{i}" for i in inputs_of] + [f"kwargs{i}" for i in inputs_of]
                                              + [f"out{i}" for i in outputs_of])
            if inputs_of == [1, 3]:  # both are handed the same rotary table: the capture keeps one copy of it
                assert captured["kwargs1"]["position_embeddings"] is captured["kwargs3"]["position_embeddings"]
    finally:
        for handle in handles:
            handle.remove()


def test_saved_and_checked_by_kind(tmp_path):
    model, _ = tiny_vlm("llama", num_hidden_layers=7)
    spec = resolve(model)
    layers = spec.get_layers(model)
    states = {i: standalone_layer(layers[i]).state_dict() for i in (1, 3)}
    save_replacements(tmp_path, states, REMOVED)
    loaded, removed = load_replacements(tmp_path)
    assert removed == REMOVED and sorted(loaded) == [1, 3]
    assert all(torch.equal(loaded[i][k], v) for i in (1, 3) for k, v in states[i].items())
    check_replacements(loaded, REMOVED, removed, hidden_size=64, source="adapter", layers=layers)
    other, _ = tiny_vlm("llama", num_hidden_layers=7, intermediate_size=96)
    with pytest.raises(ValueError, match="do not fit this backbone"):
        check_replacements(loaded, REMOVED, removed, hidden_size=64, source="adapter", layers=spec.get_layers(other))
    with pytest.raises(ValueError, match="all linear maps or all layers"):
        save_replacements(tmp_path, {1: states[1], 3: torch.eye(64)}, REMOVED)


def _module(**kwargs):
    """The linear replacement tests' tiny healing run (LoRA, layers 2-3 removed), with a layer replacement."""
    return _healing_module(**{"replacement": "layer", "replacement_epochs": 3, **kwargs})


def test_module_fits_a_layer_trains_with_it_resumes_it_and_ships_it_pruned(tmp_path, capsys):
    from vlm_retrofit import load_release
    from vlm_retrofit.cli import main
    from vlm_retrofit.routing import AdapterMismatchError
    from vlm_retrofit.release import load_checkpoint, load_trained, merge

    module, data = _module(), _data(seed=0)
    base, _ = tiny_vlm("llama", num_hidden_layers=6)
    expected = fit_layer_replacements(base, resolve(base), [2, 3],
                                      [(inputs, inputs["attention_mask"].bool())
                                       for inputs, _ in map(module.model_inputs, data.train_batches)], epochs=3)
    _trainer(3, tmp_path / "run").fit(module, data)
    assert sorted(module.replacements) == [1]  # span [2, 3] is carried by layer 1
    fitted = module.replacements
    for name, value in expected[1].items():  # fitted on the frozen base, LoRA and routers out of the way
        torch.testing.assert_close(fitted[1][name], value, atol=1e-5, rtol=1e-4)
    layer1 = module.adapter.spec.get_layers(module.model)[1]
    assert any(not torch.equal(v, standalone_layer(layer1).state_dict()[k]) for k, v in fitted[1].items())

    # The student runs layer 1's new weights: its own weights as the replacement are plain removal.
    batch = data.train_batches[0]

    def kl(replacements):
        module.replacements = replacements
        with torch.no_grad():
            return module.compute_loss(batch, drop_rate=0.0, seed=0).kl

    plain = kl(None)
    # Layer 1's own weights as its replacement are plain removal (its LoRA, which the student never runs, is still
    # at B = 0 here, so the two agree).
    torch.testing.assert_close(kl({1: standalone_layer(layer1).state_dict()}), plain)
    assert abs(kl(fitted) - plain) > 1e-4
    module.replacements = fitted

    # A resumed run keeps the checkpoint's replacement, even on other data; another kind is refused.
    (ckpt,) = (tmp_path / "run").rglob("*.ckpt")
    resumed = _module()
    _trainer(4, tmp_path / "resumed").fit(resumed, _data(seed=1), ckpt_path=str(ckpt))
    assert all(torch.equal(resumed.replacements[1][k], v) for k, v in fitted[1].items())
    with pytest.raises(AdapterMismatchError, match="with a layer replacement and this run asks for a linear one"):
        _trainer(4, tmp_path / "linear").fit(_module(replacement="linear"), _data(seed=1), ckpt_path=str(ckpt))

    # The adapter folder and the checkpoint both carry it; a pruned release holds it as layer 1's weights.
    module.save_adapter(tmp_path / "adapter")
    states, layers = load_trained(tmp_path / "adapter").replacement
    assert layers == [2, 3] and all(torch.equal(states[1][k], v) for k, v in fitted[1].items())
    # Only a pruned release runs it: routing or generating with layers 2-3 kept would count the span twice.
    for source in (tmp_path / "adapter", ckpt):
        assert main(["generate", "--model", str(source), "--prompt", "Hi"]) == 1
        assert main(["calibrate", "--model", str(source)]) == 1
        err = capsys.readouterr().err
        assert err.count("carries a replacement of removed layers [2, 3], which only a pruned release runs") == 2
    merge(ckpt, tmp_path / "pruned", prune_blocks=[2, 3])
    config = json.loads((tmp_path / "pruned" / "release_config.json").read_text())
    assert config["pruned"]["replacement_folded_into"] == [1] and config["pruned"]["replacement_kind"] == "layer"
    assert "Layers [1] (numbered as before pruning) were retrained" in (tmp_path / "pruned" / "README.md").read_text()
    released, processor = load_release(tmp_path / "pruned")
    reference = load_checkpoint(ckpt)
    reference.adapter.detach()
    model = reference.model.merge_and_unload()
    spec = resolve(model)
    inputs = tiny_inputs(processor)
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        with layers_removed(model, spec, [2, 3], substitutes(model, spec, reference.replacement[0])):
            student = model(**inputs).logits[mask]
        torch.testing.assert_close(released(**inputs).logits[mask], student, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"fitted with layers \[2, 3\] removed, but layers \[3\]"):
        merge(ckpt, tmp_path / "other", prune_blocks=[3], allow_untrained_removal=True)


def test_shared_prefix_hands_the_substitute_its_input():
    # LoRA above the removal only: the student takes layers 0 (below the replaced layer 1) from the teacher, and the
    # substitute running as layer 1 must receive the teacher's stream there.
    lora = {"r": 4, "lora_alpha": 8, "target_modules": r".*layers\.[45]\.self_attn\.(q_proj|v_proj)"}
    data = _data(seed=0)
    shared = _module(lora=lora, share_teacher_prefix=True)
    whole = _module(lora=lora, share_teacher_prefix=False)
    states = fit_layer_replacements(shared.model, shared.adapter.spec, [2, 3],
                                    [(inputs, inputs["attention_mask"].bool())
                                     for inputs, _ in map(shared.model_inputs, data.train_batches)], epochs=3)
    shared.replacements, whole.replacements = states, states
    assert shared.shared_prefix_layers([2, 3]) == 1
    batch = data.train_batches[0]
    with torch.no_grad():
        torch.testing.assert_close(shared.compute_loss(batch, drop_rate=0.0, seed=0).kl,
                                   whole.compute_loss(batch, drop_rate=0.0, seed=0).kl)
    assert shared._prefix_verified


def test_the_module_fits_from_the_stream_its_replacement_inputs_name(monkeypatch):
    import vlm_retrofit.training.module as module_file

    seen = {}
    fit = module_file.fit_layer_replacements

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return fit(*args, **kwargs)

    monkeypatch.setattr(module_file, "fit_layer_replacements", recording)
    _module(replacement_inputs="full").fit_replacement(_data(seed=0).train_batches[:1])
    assert seen["span_inputs"] == "full"
    _module().fit_replacement(_data(seed=0).train_batches[:1])
    assert seen["span_inputs"] == "replaced"  # the default: each span fitted on what the student runs it on


def test_module_refuses_bad_layer_replacement_settings():
    with pytest.raises(ValueError, match="replacement must be 'linear' or 'layer'"):
        _module(replacement="mean")
    with pytest.raises(ValueError, match="replacement_epochs >= 1 and replacement_lr > 0"):
        _module(replacement_epochs=0)
    with pytest.raises(ValueError, match="replacement_inputs must be 'replaced' or 'full'"):
        _module(replacement_inputs="teacher")
    with pytest.raises(ValueError, match="hidden_weight"):
        _module(hidden_weight=1.0)
    _module(backbone="tiny:gemma3")  # a normed MLP output refuses a linear replacement, not a layer one


def test_a_layers_standalone_shapes_are_read_without_copying_it():
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_vlm("llama", num_hidden_layers=4)
    plain = resolve(model).get_layers(model)[1]
    expected = {k: tuple(v.shape) for k, v in standalone_layer(plain).state_dict().items()}
    assert standalone_shapes(plain) == expected
    # LoRA wrappers and a `modules_to_save` copy read as the modules they wrap: the plain layer's names and shapes.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["o_proj"])
    wrapped = get_peft_model(model, config)
    layer = resolve(wrapped).get_layers(wrapped)[1]
    names = list(layer.state_dict())
    assert any("lora_A" in name for name in names) and any("modules_to_save" in name for name in names)
    copied = {k: tuple(v.shape) for k, v in standalone_layer(layer).state_dict().items()}
    assert standalone_shapes(layer) == expected == copied


@pytest.mark.parametrize("replacement", ["layer", "linear"])
def test_a_static_removal_through_the_routers_runs_what_the_student_runs(replacement):
    """`replacement_applied`: the model run whole with the replacement in place and the replaced span skipped by the
    routers' static policy (what SkipAwareGenerationCallback generates with in a healing run) computes the healing
    student's logits; without it the span is skipped with layer 1's own weights; fitted for other layers, or after
    the context, nothing is left in place."""
    from vlm_retrofit.callbacks import compare_generation

    module, data = _module(replacement=replacement), _data(seed=0)
    with torch.no_grad():
        module.fit_replacement(data.train_batches)
    assert sorted(module.replacements) == [1]
    torch.manual_seed(0)  # the LoRA away from B = 0, as after healing steps: the student runs it on kept layers only
    for name, parameter in module.model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.05)
    inputs, mask = module.model_inputs(data.train_batches[0])
    layers = module.adapter.spec.get_layers(module.model)
    with torch.no_grad():
        student = module._removal_forward(inputs, None, [2, 3]).logits[mask]
        with module.replacement_applied([2, 3]), module.adapter.skipping("static", blocks=[2, 3]):
            routed = module.model(**inputs).logits[mask]
        with module.adapter.skipping("static", blocks=[2, 3]):
            plain = module.model(**inputs).logits[mask]
        whole = module.model(**inputs).logits[mask]
        with module.replacement_applied([3]):  # not the removal it was fitted for: nothing replaced
            assert "forward" not in vars(layers[1])
            torch.testing.assert_close(module.model(**inputs).logits[mask], whole)
    torch.testing.assert_close(routed, student, atol=1e-4, rtol=1e-4)
    assert (plain - student).abs().max() > 1e-3
    assert "forward" not in vars(layers[1])  # restored

    # The callback's comparison takes it as the skipping side's context: with it the skipping side is the student.
    tokenizer = module.processor
    prompt = {k: v[:1] for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    entered = []

    def context():
        entered.append(True)
        return module.replacement_applied([2, 3])

    metrics, report = compare_generation(module.model, module.adapter, [prompt], "static", {"blocks": [2, 3]},
                                         tokenizer, max_new_tokens=3, skip_context=context)
    assert entered == [True] and report.skipped_layer_fraction > 0

    # A callback whose calibration removes other layers says so, once: its token match is then the bare removal's.
    from vlm_retrofit.callbacks import SkipAwareGenerationCallback

    callback = SkipAwareGenerationCallback(target_saving=0.25)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback._warn_if_replacement_unused(module, [2, 3])
        assert not caught
        callback._warn_if_replacement_unused(module, [3])
        callback._warn_if_replacement_unused(module, [3])
    assert len(caught) == 1 and "removes layers [3], and the replacement was fitted for layers [2, 3]" in str(
        caught[0].message)
