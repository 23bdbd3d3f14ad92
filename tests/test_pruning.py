"""Pruning: deleted layers equal static removal on every family (in place and in a context), pruned releases, refusals."""

import copy
import dataclasses
import json
import re

import pytest
import torch

from vlm_retrofit import RouterConfig, attach_routers, load_release
from vlm_retrofit.backbones import resolve
from vlm_retrofit.backbones.loading import load_backbone
from vlm_retrofit.cli import main
from vlm_retrofit.pruning import blocks_to_prune, layers_removed, prune_layers
from vlm_retrofit.release import load_trained, merge
from vlm_retrofit.skipping import untrained_removal
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm

from conftest import fit_config


def _real_logits(model, inputs):
    # Padding rows differ between attention kernels (a reloaded model may pick another): compare real tokens.
    with torch.no_grad():
        return model(**inputs).logits[inputs["attention_mask"].bool()]


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_model_equals_static_removal_and_reloads(family, tmp_path):
    model, processor = tiny_vlm(family, num_hidden_layers=6)
    inputs = tiny_inputs(processor)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    blocks = list(adapter.layout.skippable_blocks)[-2:]  # after any layer the backbone injects into by index
    with torch.no_grad(), adapter.skipping("static", blocks=blocks):
        expected = _real_logits(model, inputs)
        expected_tokens = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    spec = adapter.spec
    adapter.detach()

    assert prune_layers(model, spec, blocks) == blocks
    text_config = model.config.get_text_config()
    assert text_config.num_hidden_layers == len(spec.get_layers(model)) == 4
    assert all(len(v) == 4 for k, v in vars(text_config).items() if k == "layer_types" and v is not None)
    torch.testing.assert_close(_real_logits(model, inputs), expected, atol=1e-5, rtol=0)
    with torch.no_grad():  # the KV cache has one slot per kept layer: renumbered layers must fill exactly those
        assert torch.equal(model.generate(**inputs, max_new_tokens=5, do_sample=False), expected_tokens)

    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    reloaded, _ = load_backbone(str(tmp_path))
    assert reloaded.config.get_text_config().num_hidden_layers == 4
    torch.testing.assert_close(_real_logits(reloaded, inputs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3", "aya_vision"])  # masks (and rotary) chosen per layer type
def test_layers_removed_in_context_equals_static_removal_with_routers_at_init_with_and_without_cache(family):
    model, tokenizer = tiny_vlm(family, num_hidden_layers=6)
    inputs = dict(tiny_inputs(tokenizer, batch=2))  # left-padded: the cache of removed layers must not matter
    identity = attach_routers(model, RouterConfig(block_size=1))
    spec = identity.spec
    with torch.no_grad(), identity.skipping("static", blocks=[2, 4]):
        static_logits = model(**inputs).logits
        static_tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    identity.detach()
    text_config = spec.get_text_config(model)
    before = (dict(vars(text_config)), [layer.self_attn.layer_idx for layer in spec.get_layers(model)])
    with torch.no_grad(), layers_removed(model, spec, [2, 4]):
        assert len(spec.get_layers(model)) == text_config.num_hidden_layers == 4
        deleted_logits = model(**inputs).logits
        deleted_tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert len(spec.get_layers(model)) == 6  # restored: layers, their numbering and the config
    assert (dict(vars(text_config)), [layer.self_attn.layer_idx for layer in spec.get_layers(model)]) == before
    with pytest.raises(ValueError, match="out of range"), layers_removed(model, spec, [6]):
        pass
    assert (dict(vars(text_config)), [layer.self_attn.layer_idx for layer in spec.get_layers(model)]) == before
    torch.testing.assert_close(deleted_logits, static_logits, atol=1e-4, rtol=0)
    assert torch.equal(deleted_tokens, static_tokens)


@pytest.mark.parametrize("family, kind, mixer", [("lfm2_vl", "conv", "conv"),
                                                 ("qwen3_5", "linear_attention", "linear_attn")])
def test_a_hybrid_prunes_attention_layers_between_its_recurrent_layers(tmp_path, family, kind, mixer):
    """A hybrid's layers without attention (LFM2's convolutions, Qwen3.5's Gated DeltaNets) never skip (they have
    no kv-only path), but nothing is injected at their index: the attention layers between them prune, and the
    recurrent layers after them take their new numbers (the slots of their states in the hybrid cache) and layer
    types."""
    model, processor = tiny_vlm(family, num_hidden_layers=6, layer_types=["full_attention", kind] * 3)
    inputs = tiny_inputs(processor)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    assert adapter.layout.skippable_blocks == (2, 4)
    with torch.no_grad(), adapter.skipping("static", blocks=[2, 4]):
        expected = _real_logits(model, inputs)
        expected_tokens = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    spec = adapter.spec
    adapter.detach()
    with torch.no_grad(), layers_removed(model, spec, [2, 4]):
        torch.testing.assert_close(_real_logits(model, inputs), expected, atol=1e-5, rtol=0)
        assert torch.equal(model.generate(**inputs, max_new_tokens=5, do_sample=False), expected_tokens)
    assert [getattr(layer, mixer).layer_idx for layer in spec.get_layers(model)[1::2]] == [1, 3, 5]  # restored
    assert model.config.get_text_config().layer_types == ["full_attention", kind] * 3

    assert prune_layers(model, spec, [2, 4]) == [2, 4]
    assert model.config.get_text_config().layer_types == ["full_attention", kind, kind, kind]
    assert [getattr(layer, mixer).layer_idx for layer in spec.get_layers(model)[1:]] == [1, 2, 3]
    torch.testing.assert_close(_real_logits(model, inputs), expected, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, max_new_tokens=5, do_sample=False), expected_tokens)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    reloaded, _ = load_backbone(str(tmp_path))
    torch.testing.assert_close(_real_logits(reloaded, inputs), expected, atol=1e-4, rtol=0)


def test_prune_layers_refuses_bad_requests():
    model, _ = tiny_vlm("llama")
    spec = attach_routers(model, RouterConfig()).spec
    for layers, message in (([], "empty"), ([4], "out of range"), ([0, 1, 2, 3], "no model")):
        with pytest.raises(ValueError, match=message):
            prune_layers(model, spec, layers)
    assert len(spec.get_layers(model)) == 4  # nothing was touched

    model, _ = tiny_vlm("qwen3_vl", num_hidden_layers=6)
    spec = attach_routers(model, RouterConfig()).spec
    injected = list(spec.feature_injection_layers(model.config))
    assert injected, "tiny Qwen3-VL should inject deepstack features"
    with pytest.raises(ValueError, match="injects features"):
        prune_layers(model, spec, [injected[-1]])


def test_only_feature_injection_layers_keep_the_layers_below_them_from_pruning():
    # A layer that always runs because a skipped token could not run it (a hybrid's recurrent layer) is renumbered
    # by pruning like any other; one after which features are added by index pins every layer up to it. The two
    # were one field before, and pruning told them apart by whether the layer had attention.
    model, _ = tiny_vlm("llama", num_hidden_layers=6)
    spec = resolve(model)
    always_runs = dataclasses.replace(spec, never_skip_layers=lambda config: [3])
    injects = dataclasses.replace(spec, feature_injection_layers=lambda config: [3])
    both = dataclasses.replace(always_runs, feature_injection_layers=lambda config: [1])
    assert [s.always_run_layers(model.config) for s in (always_runs, injects, both)] == [(3,), (3,), (1, 3)]
    assert prune_layers(copy.deepcopy(model), always_runs, [1, 2]) == [1, 2]
    with pytest.raises(ValueError, match=r"injects features at layers \[3\] by index; only layers after 3"):
        prune_layers(model, injects, [2])
    assert len(spec.get_layers(model)) == 6  # refused before anything was deleted
    assert prune_layers(model, injects, [4]) == [4]


def test_blocks_to_prune_reads_calibration_then_removal_order():
    model, _ = tiny_vlm("llama", num_hidden_layers=8)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    with pytest.raises(ValueError, match="no static calibration"):
        blocks_to_prune(adapter, target_saving=0.25)
    with pytest.raises(ValueError, match="either blocks or target_saving"):
        blocks_to_prune(adapter)
    with pytest.raises(ValueError, match=r"blocks \[0\] cannot be pruned"):
        blocks_to_prune(adapter, blocks=[0, 3])
    adapter.removal_order = [5, 2, 3, 6]
    assert blocks_to_prune(adapter, target_saving=0.25) == [2, 5]  # 2 of 8 layers
    adapter.calibration["static"] = {"0.2500": {"blocks": [6, 3]}}
    assert blocks_to_prune(adapter, target_saving=0.25) == [3, 6]  # a stored calibration wins
    assert blocks_to_prune(adapter, blocks=[4]) == [4]


@pytest.fixture(scope="module")
def trained_removal(tmp_path_factory):
    """A short `fit` with the removal schedule and LoRA on tiny Qwen2-VL: its exported adapter folder."""
    run = tmp_path_factory.mktemp("run")
    fit_config(run, "tiny-removal.yaml", "--trainer.max_steps", "3", "--trainer.callbacks", "[]", "--model.lora",
               '{"r": 4, "lora_alpha": 8, "target_modules": ".*language_model.*\\\\.(q_proj|v_proj)"}')
    return run / "runs" / "tiny-removal" / "adapter"


def test_merge_prune_target_writes_a_plain_shallower_model(trained_removal, tmp_path, capsys):
    source = load_trained(trained_removal)
    assert source.lora and source.adapter.removal_order is not None
    blocks = blocks_to_prune(source.adapter, target_saving=0.25)  # 2 of 8 layers
    inputs = tiny_inputs(source.processor)
    with source.adapter.skipping("static", blocks=blocks):
        routed = _real_logits(source.model, inputs)
    # The reference: the same weights (LoRA merged) with the blocks removed by plain layer dropping.
    plain = source.model.merge_and_unload()
    source.adapter.detach()
    identity = attach_routers(plain, RouterConfig.from_dict(source.adapter.config.to_dict()))
    with torch.no_grad(), identity.skipping("static", blocks=blocks):
        expected = _real_logits(plain, inputs)
        expected_tokens = plain.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert (routed - expected).abs().max() > 1e-5  # the trained routers matter: the release drops them

    assert main(["merge", "--ckpt", str(trained_removal), "--output", str(tmp_path / "pruned"), "--prune-target", "0.25"]) == 0
    assert "release written" in capsys.readouterr().out
    config = json.loads((tmp_path / "pruned" / "release_config.json").read_text())
    assert config["pruned"]["removed_layers"] == blocks and config["pruned"]["num_layers_before"] == 8
    assert config["lora"] == "merged" and not (tmp_path / "pruned" / "router").exists()
    assert config["pruned"]["removal_trained"] is True
    assert 0 < config["pruned"]["routers_dropped"]["kl_routed_to_pruned"]
    assert "routers were dropped" in (tmp_path / "pruned" / "README.md").read_text()

    model, processor = load_release(tmp_path / "pruned")
    assert len(model.model.language_model.layers) == 6
    torch.testing.assert_close(_real_logits(model, inputs), expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, max_new_tokens=5, do_sample=False), expected_tokens)
    # transformers alone loads it: no routers, no hooks, nothing of vlm_retrofit needed.
    alone, _ = load_backbone(str(tmp_path / "pruned" / "model"), processor_from=str(tmp_path / "pruned" / "processor"))
    torch.testing.assert_close(_real_logits(alone, inputs), expected, atol=1e-4, rtol=0)


def test_pruned_release_commands_and_refusals(trained_removal, tmp_path, capsys):
    first = json.loads((trained_removal / "adapter_config.json").read_text())["removal_order"][0]
    assert main(["merge", "--ckpt", str(trained_removal), "--output", str(tmp_path / "pruned"),
                 "--prune-blocks", str(first)]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "pruned"), "--prompt", "Hi", "--max-new-tokens", "3"]) == 0
    assert f"[pruned release] decoder layers [{first}] of 8 deleted" in capsys.readouterr().out
    assert main(["generate", "--model", str(tmp_path / "pruned"), "--prompt", "Hi", "--max-new-tokens", "3",
                 "--compare-base"]) == 0
    out = capsys.readouterr().out
    assert "base model: " in out and re.search(r"agreement with the base's answer: \d/3 tokens; decode \d+\.\d\dx", out)
    # Refused from the release config alone, before any weights load.
    from vlm_retrofit import commands, release

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded weights to refuse")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(commands, "load_trained", no_loading)
        patch.setattr(release, "load_trained", no_loading)
        assert main(["generate", "--model", str(tmp_path / "pruned"), "--prompt", "Hi", "--skip-policy", "static",
                     "--target-saving", "0.2"]) == 1
        assert "drop --skip-policy" in capsys.readouterr().err
        assert main(["calibrate", "--model", str(tmp_path / "pruned"), "--policy", "static"]) == 1
        assert "pruned release" in capsys.readouterr().err
        with pytest.raises(ValueError, match="pruned release"):
            merge(tmp_path / "pruned", tmp_path / "again")
    # A block that may not be removed is refused before anything is written.
    assert main(["merge", "--ckpt", str(trained_removal), "--output", str(tmp_path / "bad"), "--prune-blocks", "0"]) == 1
    assert "cannot be pruned" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_untrained_removal_is_named_and_refused_unless_asked_for():
    model, _ = tiny_vlm("llama", num_hidden_layers=8)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    adapter.removal_order = [5, 2, 3, 6]
    assert untrained_removal(adapter, [6]) is None  # no removal schedule recorded: nothing to hold it to
    adapter.removal_range = (2, 2)  # healed for the first two blocks of the order only
    assert untrained_removal(adapter, [5, 2]) is None
    assert blocks_to_prune(adapter, target_saving=0.25) == [2, 5]
    fewer = untrained_removal(adapter, [5])
    assert "first 2 blocks of its removal order [5, 2]" in fewer and "0.250 of the layers" in fewer
    assert untrained_removal(adapter, [5, 3]) is not None  # as many blocks, not the ones it was trained without
    for request in ({"target_saving": 0.125}, {"target_saving": 0.375}, {"blocks": [3, 6]}):
        with pytest.raises(ValueError, match=r"not what this adapter was trained for.*--allow-untrained-removal"):
            blocks_to_prune(adapter, **request)
    assert blocks_to_prune(adapter, target_saving=0.375, allow_untrained=True) == [2, 3, 5]
    adapter.removal_range = (0, 3)  # a schedule over 0..3 blocks trained every prefix up to 3
    assert all(untrained_removal(adapter, adapter.removal_order[:k]) is None for k in range(1, 4))
    assert "0.125 to 0.375 of the layers" in untrained_removal(adapter, adapter.removal_order)


def test_merge_refuses_a_removal_the_adapter_was_not_trained_for(trained_removal, tmp_path, capsys):
    saved = json.loads((trained_removal / "adapter_config.json").read_text())
    assert saved["removal_range"] == [0, 3]  # tiny-removal.yaml: k drawn from 0..3
    last = saved["removal_order"][-1]  # never removed in training
    args = ["merge", "--ckpt", str(trained_removal), "--output", str(tmp_path / "pruned"), "--prune-blocks", str(last)]
    assert main(args) == 1
    assert "merge refused: removing blocks" in capsys.readouterr().err and not (tmp_path / "pruned").exists()
    assert main([*args, "--allow-untrained-removal"]) == 0
    config = json.loads((tmp_path / "pruned" / "release_config.json").read_text())
    assert config["pruned"]["removed_blocks"] == [last] and config["pruned"]["removal_trained"] is False
    assert "trained for another removal" in (tmp_path / "pruned" / "README.md").read_text()


def test_a_pruned_release_is_the_backbone_of_a_new_retrofit(trained_removal, tmp_path):
    assert main(["merge", "--ckpt", str(trained_removal), "--output", str(tmp_path / "pruned"), "--prune-target", "0.25"]) == 0
    release, processor = load_release(tmp_path / "pruned")
    inputs = tiny_inputs(processor)
    expected = _real_logits(release, inputs)

    # The release folder itself names the backbone: its model/ and processor/, 6 of the 8 layers.
    model, _ = load_backbone(str(tmp_path / "pruned"))
    assert len(model.model.language_model.layers) == 6
    adapter = attach_routers(model, RouterConfig(block_size=1))
    torch.testing.assert_close(_real_logits(model, inputs), expected, atol=1e-5, rtol=0)  # identity at init
    adapter.detach()

    # `fit` on it (the data's processor follows the backbone), and the adapter loads back onto the release.
    fit_config(tmp_path, "tiny-removal.yaml", "--trainer.max_steps", "2", "--trainer.callbacks", "[]",
               "--model.backbone", str(tmp_path / "pruned"), "--model.backbone_kwargs", "null",
               "--model.max_removed_blocks", "2")
    stacked = load_trained(tmp_path / "runs" / "tiny-removal" / "adapter")
    assert stacked.adapter.layout.num_layers == 6 and stacked.base_model["name"] == str(tmp_path / "pruned")
    with torch.no_grad(), stacked.adapter.disabled():
        torch.testing.assert_close(_real_logits(stacked.model, inputs), expected, atol=1e-5, rtol=0)

    # A release that computes with its trained routers (with or without full weights) is refused, saying what to do.
    for name, extra in (("routers", []), ("full", ["--full-weights"])):
        assert main(["merge", "--ckpt", str(trained_removal), "--output", str(tmp_path / name), *extra]) == 0
        with pytest.raises(ValueError, match="trained routers.*--prune-target"):
            load_backbone(str(tmp_path / name))


def test_what_training_wrote_loads_in_another_dtype_and_a_slow_one_is_noted(trained_removal, monkeypatch, capsys):
    # A bf16 release on a CPU without fast bf16 kernels decoded some 70x slower than in fp32, with no way to say
    # otherwise on the command line.
    import torch

    from vlm_retrofit import hardware
    from vlm_retrofit.backbones.loading import floating_dtype
    from vlm_retrofit.release import warn_about_slow_dtype

    loaded = load_trained(trained_removal, torch_dtype="bfloat16")
    assert floating_dtype(loaded.model) == torch.bfloat16 and loaded.base_model["torch_dtype"] == "bfloat16"
    monkeypatch.setattr(hardware, "_cpu_has_fast_bf16", lambda: False)
    warn_about_slow_dtype("generate", loaded.model)
    assert "generate: note: these weights are bfloat16" in capsys.readouterr().err
    warn_about_slow_dtype("generate", load_trained(trained_removal).model)  # fp32: nothing to say
    assert capsys.readouterr().err == ""
    assert main(["generate", "--model", str(trained_removal), "--prompt", "Hi", "--max-new-tokens", "2",
                 "--dtype", "bfloat16", "--compare-base"]) == 0
    assert "note:" not in capsys.readouterr().err  # asked for: not noted
