"""Backbone registry: every family resolves, unknown ones are refused helpfully, plug-ins register cleanly."""

import copy

import pytest
import torch
from torch import nn
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM,
                          SmolLM3Config, SmolLM3ForCausalLM, StableLmConfig, StableLmForCausalLM)

from vlm_retrofit import BackboneSpec, RouterAdapter, RouterConfig, attach_routers, get_adapter, register_backbone
from vlm_retrofit.backbones import (base_fingerprint, image_positions, resolve, supported_model_types,
                                   unchanged_fingerprint)
from vlm_retrofit.backbones.registry import evenly_spaced, unregister_backbone
from vlm_retrofit.routing import AdapterMismatchError, check_fingerprint, check_identity
from vlm_retrofit.skipping import check_skip_consistency
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_resolves_to_parts_the_kv_path_needs(family):
    model, _ = tiny_vlm(family)
    assert family in supported_model_types()
    spec = resolve(model)
    layers = spec.get_layers(model)
    assert len(layers) == 4
    parts = spec.attention_parts(layers[0])
    assert callable(parts.rotary_fn) and parts.k_proj.out_features == parts.v_proj.out_features
    assert spec.get_embed_tokens(model).weight.shape[0] == spec.get_lm_head(model).weight.shape[0]
    image_ids = spec.image_token_ids(model.config)
    assert bool(image_ids) == (family not in {"llama", "qwen2"})


def test_image_positions_mark_placeholders_and_are_none_without_any():
    model, processor = tiny_vlm("llava")
    ids = torch.tensor(sorted(resolve(model).image_token_ids(model.config)), dtype=torch.long)
    inputs = tiny_inputs(processor, batch=2)
    mask = image_positions(inputs["input_ids"], ids)
    assert mask.shape == inputs["input_ids"].shape and bool(mask.any()) and not bool(mask.all())
    assert torch.equal(mask, inputs["input_ids"] == int(ids[0]))
    assert image_positions(inputs["input_ids"][:, :1], ids) is None  # the first token (no placeholder there)
    assert image_positions(inputs["input_ids"], torch.empty(0, dtype=torch.long)) is None  # a text-only family
    assert image_positions(None, ids) is None  # called with embeddings


def test_qwen3_vl_deepstack_layers_are_never_skipped():
    model, _ = tiny_vlm("qwen3_vl", num_hidden_layers=8)
    deepstack = len(model.config.vision_config.deepstack_visual_indexes)
    assert deepstack >= 1
    layout = attach_routers(model, RouterConfig(block_size=1, never_skip_blocks=[])).layout
    assert set(range(deepstack)) <= set(layout.never_skip_blocks)
    assert not set(range(deepstack)) & set(layout.skippable_blocks)


def test_unsupported_model_is_refused_with_the_way_forward():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError) as err:
        attach_routers(model)
    message = str(err.value)
    assert "'gpt2'" in message and "register_backbone" in message and "qwen2_vl" in message


def test_an_unsupported_folder_is_refused_in_one_line_before_its_weights_load(tmp_path, monkeypatch, capsys):
    # Before: fit loaded the whole model first (minutes for a 7B), then failed with a LightningCLI traceback.
    import transformers

    from vlm_retrofit.cli import main

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    for auto in ("AutoModelForImageTextToText", "AutoModelForCausalLM"):
        monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", no_weights)
    assert main(["fit", "--model.backbone", str(tmp_path / "gpt2"), "--trainer.max_steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "fit refused: model_type 'gpt2' is not a supported backbone" in err and "entry point" in err


def test_an_installed_plug_in_registers_its_family_where_it_is_first_needed(monkeypatch):
    # The command line, and every process that loads an adapter or release, cannot call register_backbone: an
    # installed package's entry point does it for them.
    from importlib.metadata import EntryPoint

    import vlm_retrofit.backbones.registry as registry

    entries = [EntryPoint("toy", f"{__name__}:register_toy", registry.PLUGIN_GROUP)]
    monkeypatch.setattr("importlib.metadata.entry_points",
                        lambda group=None: [e for e in entries if e.group == group])
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    model = ToyForCausalLM(ToyConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    try:
        assert resolve(model) is registry._REGISTRY["toy_llama"] and "toy_llama" in supported_model_types()
    finally:
        unregister_backbone("toy_llama")
    # A broken plug-in is named where its family is missing, and does not keep the others from registering.
    entries[:] = [EntryPoint("broken", "no_such_module_here:register", registry.PLUGIN_GROUP), *entries]
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "_plugin_failures", [])
    try:
        assert resolve(model) is registry._REGISTRY["toy_llama"]
    finally:
        unregister_backbone("toy_llama")
    with pytest.raises(ValueError, match="'toy_llama' is not a supported.*plug-in 'broken'.*ModuleNotFoundError"):
        resolve(model)


def test_a_plug_in_for_a_family_transformers_does_not_know_is_loaded_before_its_folder_is_read(tmp_path, monkeypatch):
    # Before: load_backbone read the folder's config before any plug-in ran, so a family whose plug-in also
    # registers its transformers classes failed with "Transformers does not recognize this architecture".
    from importlib.metadata import EntryPoint

    import transformers

    import vlm_retrofit.backbones.registry as registry
    from vlm_retrofit.backbones.loading import load_backbone

    model = ToyForCausalLM(ToyConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(tmp_path / "toy")
    tiny_vlm("llama")[1].save_pretrained(tmp_path / "toy")  # its tokenizer
    entries = [EntryPoint("toy", f"{__name__}:register_toy_with_transformers", registry.PLUGIN_GROUP)]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group=None: [e for e in entries if e.group == group])
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    try:
        loaded, _ = load_backbone(str(tmp_path / "toy"))
        assert type(loaded) is ToyForCausalLM and resolve(loaded) is registry._REGISTRY["toy_llama"]
    finally:
        registry._REGISTRY.pop("toy_llama", None)
        # What the plug-in's register() calls wrote: other tests must not find the toy family known.
        transformers.models.auto.configuration_auto.CONFIG_MAPPING._extra_content.pop("toy_llama", None)
        transformers.AutoModelForCausalLM._model_mapping._extra_content.pop(ToyConfig, None)


def register_toy():
    register_backbone("toy_llama", BackboneSpec())


def register_toy_with_transformers():
    import transformers

    transformers.AutoConfig.register("toy_llama", ToyConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(ToyConfig, ToyForCausalLM, exist_ok=True)
    register_toy()


class ToyConfig(LlamaConfig):
    model_type = "toy_llama"


class ToyForCausalLM(LlamaForCausalLM):
    config_class = ToyConfig


def test_a_registered_plug_in_family_gets_exact_routers():
    model = ToyForCausalLM(ToyConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    inputs = {"input_ids": torch.randint(0, 64, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    with pytest.raises(ValueError, match="toy_llama"):
        resolve(model)
    register_backbone("toy_llama", BackboneSpec())
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_backbone("toy_llama", BackboneSpec())
        assert check_identity(model, inputs) <= 1e-4
        assert check_skip_consistency(model, {k: v[:1] for k, v in inputs.items()}) <= 1e-4
    finally:
        unregister_backbone("toy_llama")


class _MixesPositions(nn.Module):
    """An MLP that is not position-wise: each token's output also reads the mean of every token's input."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden):
        return self.mlp(hidden) + hidden.mean(dim=1, keepdim=True)


def test_the_skip_check_refuses_a_spec_whose_mlp_attr_names_an_mlp_that_is_not_position_wise():
    # A block some tokens skip runs the spec's MLP on the other tokens only, which is exact for a position-wise MLP
    # alone: one that mixes positions silently computes something else there.
    model = ToyForCausalLM(ToyConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    for layer in model.model.layers:
        layer.mlp = _MixesPositions(layer.mlp)
    inputs = {"input_ids": torch.randint(0, 64, (1, 7)), "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    register_backbone("toy_llama", BackboneSpec())
    try:
        with pytest.raises(AssertionError, match=r"mlp_attr \('mlp'\) must name a position-wise MLP, or be None"):
            check_skip_consistency(model, inputs)
        register_backbone("toy_llama", BackboneSpec(mlp_attr=None), overwrite=True)
        with pytest.raises(AssertionError, match="generates other logits than without it"):  # the cache mixes too
            check_skip_consistency(model, inputs)
    finally:
        unregister_backbone("toy_llama")


def test_routers_saved_under_one_registration_are_refused_under_another_that_moves_their_layout(tmp_path):
    # The registration is not saved with the adapter: a process that registered the family without its never-skip
    # layers loaded the routers silently, and they then skipped blocks they were trained never to skip.
    model = ToyForCausalLM(ToyConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    register_backbone("toy_llama", BackboneSpec(never_skip_layers=lambda config: [2]))
    try:
        adapter = attach_routers(model, RouterConfig())
        assert adapter.layout.skippable_blocks == (1, 3)
        adapter.save_pretrained(tmp_path / "adapter")
        adapter.detach()
        register_backbone("toy_llama", BackboneSpec(), overwrite=True)
        with pytest.raises(AdapterMismatchError, match=r"skippable_blocks: saved \[1, 3\] vs now \[1, 2, 3\].*"
                                                       r"never_skip_layers"):
            RouterAdapter.from_pretrained(model, tmp_path / "adapter")
        assert get_adapter(model) is None  # refused before anything was attached
        register_backbone("toy_llama", BackboneSpec(never_skip_layers=lambda config: [2]), overwrite=True)
        assert RouterAdapter.from_pretrained(model, tmp_path / "adapter").layout.skippable_blocks == (1, 3)
    finally:
        unregister_backbone("toy_llama")


@pytest.mark.parametrize("family, missing", [("phi3", "together \\('qkv_proj'\\).*cannot skip blocks"),
                                             ("stablelm", "partial_rotary_factor 0.25.*BackboneSpec\\(rotary_fn=...\\)")])
def test_a_plug_in_family_whose_kv_path_cannot_run_passes_identity_and_fails_the_skip_check_by_name(family, missing):
    # Identity at init never runs the kv-only path of a skipped layer: these passed it, then crashed (phi3) or
    # would have written wrongly rotated keys (stablelm) on the first generate under skipping.
    config_class, model_class = {"phi3": (Phi3Config, Phi3ForCausalLM),
                                 "stablelm": (StableLmConfig, StableLmForCausalLM)}[family]
    model = model_class(config_class(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).eval()
    inputs = {"input_ids": torch.randint(1, 64, (1, 7)), "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    register_backbone(family, BackboneSpec())
    try:
        assert check_identity(model, inputs) <= 1e-4
        with pytest.raises(AssertionError, match=missing):
            check_skip_consistency(model, inputs)
        assert get_adapter(model) is None  # the check leaves the model as it was given
    finally:
        unregister_backbone(family)


def test_a_plug_in_family_with_layers_that_rotate_no_keys_skips_consistently():
    # SmolLM3's `no_rope_layers`: the kv-only path rotated the keys of its last layer, which the layer itself does
    # not, and generation under skipping silently differed from the no-cache reference.
    model = SmolLM3ForCausalLM(SmolLM3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                             eos_token_id=1, bos_token_id=2, no_rope_layers=[1, 0, 1, 0])).eval()
    with torch.no_grad():  # larger keys make a wrong rotation show far above the check's tolerance
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(8)
    inputs = {"input_ids": torch.randint(3, 64, (1, 7)), "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    register_backbone("smollm3", BackboneSpec(never_skip_layers=lambda config: [0]))  # let layer 1 skip
    try:
        assert check_identity(model, inputs) <= 1e-4
        assert check_skip_consistency(model, inputs) <= 1e-4
    finally:
        unregister_backbone("smollm3")


def test_the_skip_check_compares_cached_keys_not_only_logits_and_covers_every_kind_of_layer():
    # Cohere 2's full-attention layers rotate no keys. A spec that rotates them passed the check: the wrong keys
    # moved a tiny random model's logits by 3e-5 at most (under the 1e-4 tolerance), and on 4 layers the only
    # full-attention layer sits in the last block, which never skips, so its path was never run.
    from transformers import Cohere2Config, Cohere2ForCausalLM

    def cohere2(layers):
        torch.manual_seed(0)
        config = Cohere2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                               pad_token_id=0, eos_token_id=1, bos_token_id=2)
        return Cohere2ForCausalLM(config).eval()

    inputs = {"input_ids": torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(1)),
              "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    right = BackboneSpec(uses_rotary=lambda attention: attention.sliding_window is not None)
    try:
        register_backbone("cohere2", BackboneSpec())
        with pytest.raises(AssertionError, match=r"other K/V than the layers themselves do \(layer 3 keys off by"):
            check_skip_consistency(cohere2(8), inputs)
        with pytest.raises(AssertionError, match=r"no 'full_attention' layer \(layers \[3\]\) may skip"):
            check_skip_consistency(cohere2(4), inputs)
        register_backbone("cohere2", right, overwrite=True)
        assert check_skip_consistency(cohere2(8), inputs) <= 1e-4
    finally:
        unregister_backbone("cohere2")


def test_a_hybrid_whose_convolution_layers_never_skip_passes_the_skip_check():
    # The coverage rule refused LFM2 registered as docs/backbones.md says (its conv layers in never_skip_layers):
    # a kind kept from skipping by the spec needs no kv-only path.
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"] * 4,
                        block_auto_adjust_ff_dim=False)
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(config).eval()
    register_backbone("lfm2", BackboneSpec(
        input_norm_attr="operator_norm", final_norm_attr="embedding_norm", k_norm_attr="k_layernorm",
        mlp_output_attr=None, never_skip_layers=lambda c: [i for i, t in enumerate(c.layer_types) if t == "conv"]))
    inputs = {"input_ids": torch.tensor([[1, 5, 7, 9, 11, 13]]), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    try:
        assert check_skip_consistency(model, inputs, new_tokens=10) <= 1e-4
    finally:
        unregister_backbone("lfm2")


def test_a_key_norm_over_the_whole_projection_skips_consistently_and_clamped_projections_are_refused():
    # OLMoE normalises all heads' keys at once: the kv-only path normalised per head and failed on a shape. OLMo's
    # clip_qkv clamps the projections, which the kv-only path does not: refused by name, not blamed on the spec.
    from transformers import OlmoConfig, OlmoeConfig, OlmoeForCausalLM, OlmoForCausalLM

    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    inputs = {"input_ids": torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(1)),
              "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    torch.manual_seed(0)
    olmoe = OlmoeForCausalLM(OlmoeConfig(**sizes, num_experts=4, num_experts_per_tok=2)).eval()
    olmo = OlmoForCausalLM(OlmoConfig(**sizes, clip_qkv=0.05)).eval()
    for family, model in (("olmoe", olmoe), ("olmo", olmo)):
        register_backbone(family, BackboneSpec())
    try:
        assert resolve(olmoe).attention_parts(olmoe.model.layers[1]).k_norm_over_projection
        assert check_skip_consistency(olmoe, inputs) <= 1e-4
        with pytest.raises(AssertionError, match=r"clamps its projections \(clip_qkv 0.05\).*cannot skip blocks"):
            check_skip_consistency(olmo, inputs)
    finally:
        unregister_backbone("olmoe")
        unregister_backbone("olmo")


def test_a_layer_called_without_position_embeddings_is_refused_by_name_when_it_skips():
    # Remote-code models whose attention computes its own rotary: a bare KeyError('position_embeddings') before.
    from vlm_retrofit.backbones import KVPathError
    from vlm_retrofit.skipping.runtime import kv_only

    model, _ = tiny_vlm("llama")
    layer = resolve(model).get_layers(model)[1]
    parts = resolve(model).attention_parts(layer)
    with pytest.raises(KVPathError, match="without position_embeddings.*cannot skip blocks"):
        kv_only(layer, parts, torch.zeros(1, 1, model.config.hidden_size), {"cache": object()})
    # An attention that rotates no keys needs none (OPT-style families).
    from types import SimpleNamespace

    from vlm_retrofit.backbones.registry import no_rotary

    written = []
    cache = SimpleNamespace(update=lambda keys, values, index, **kw: written.append((keys.shape, index)))
    kv_only(layer, parts._replace(rotary_fn=no_rotary), torch.zeros(1, 1, model.config.hidden_size), {"cache": cache})
    assert written and written[0][1] == layer.self_attn.layer_idx


def test_a_key_norm_under_another_name_than_the_spec_says_is_refused_by_name():
    model, _ = tiny_vlm("qwen3_vl")  # its attention has `k_norm`
    spec = BackboneSpec(k_norm_attr="key_norm")
    with pytest.raises(TypeError, match=r"has 'k_norm', which looks like a per-head key norm.*k_norm_attr='k_norm'"):
        spec.attention_parts(resolve(model).get_layers(model)[0])
    assert BackboneSpec(k_norm_attr=None).attention_parts(resolve(model).get_layers(model)[0]).k_norm is None


def test_fingerprint_is_stable_and_tells_bases_apart():
    a, _ = tiny_vlm("qwen2_vl")
    b, _ = tiny_vlm("qwen2_vl")
    c, _ = tiny_vlm("qwen2_vl", hidden_size=96)
    assert base_fingerprint(a) == base_fingerprint(b)
    assert base_fingerprint(a)["text_config_sha256"] != base_fingerprint(c)["text_config_sha256"]
    assert base_fingerprint(c)["hidden_size"] == 96



@pytest.mark.parametrize("family", ["llama", "qwen2_vl", "gemma3"])
def test_fingerprint_tells_checkpoints_of_one_architecture_apart_across_dtypes(family):
    base, _ = tiny_vlm(family)
    fingerprint = base_fingerprint(base)
    assert set(fingerprint["weight_samples"]) >= {"embed_tokens", "final_norm", "first_input_norm", "last_input_norm"}
    for dtype in (torch.bfloat16, torch.float16):  # the same checkpoint loaded in another precision
        check_fingerprint(fingerprint, base_fingerprint(copy.deepcopy(base).to(dtype)), source="adapter")
    assert evenly_spaced(28_312_128, 16).tolist()[-1] == 28_312_127  # SmolLM2's embeddings: past float32's 2^24
    legacy = {k: v for k, v in fingerprint.items() if k != "weight_samples"}
    check_fingerprint(legacy, fingerprint, source="adapter")  # written before weights were sampled
    other = copy.deepcopy(base)
    with torch.no_grad():  # another checkpoint of the same config: fine-tuned embeddings
        resolve(other).get_embed_tokens(other).weight.mul_(1.05)
    assert base_fingerprint(other)["text_config_sha256"] == fingerprint["text_config_sha256"]
    with pytest.raises(AdapterMismatchError, match="same architecture .* but other weights"):
        check_fingerprint(fingerprint, base_fingerprint(other), source="adapter")


def test_fingerprint_reads_the_base_under_peft_wrappers_and_releases_drop_what_a_merge_changed():
    from peft import LoraConfig, get_peft_model

    base, _ = tiny_vlm("llama", tie_word_embeddings=False)
    fingerprint = base_fingerprint(base)
    assert "lm_head" in fingerprint["weight_samples"]
    wrapped = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():  # the trained copy of the head moves; the base's does not
        for name, param in wrapped.named_parameters():
            if "modules_to_save" in name:
                param.mul_(1.5)
    check_fingerprint(fingerprint, base_fingerprint(wrapped), source="adapter")
    merged = wrapped.merge_and_unload()  # the release's weights: the trained head
    with pytest.raises(AdapterMismatchError, match="recorded from lm_head differ"):
        check_fingerprint(fingerprint, base_fingerprint(merged), source="release")
    kept = unchanged_fingerprint(fingerprint, merged)
    assert set(kept["weight_samples"]) == set(fingerprint["weight_samples"]) - {"lm_head"}
    check_fingerprint(kept, base_fingerprint(merged), source="release")

def test_layouts_and_bad_block_indices():
    model, processor = tiny_vlm("llava", num_hidden_layers=6)
    layout = RouterConfig(block_size=2).layout(6)
    assert layout.block_starts == (0, 2, 4) and layout.never_skip_blocks == (0, 2) and layout.skippable_blocks == (1,)
    assert list(layout.layers_of_block(1)) == [2, 3]
    custom = RouterConfig(block_starts=[0, 1, 5], never_skip_blocks=[0]).layout(6)
    assert custom.skippable_blocks == (1, 2) and list(custom.layers_of_block(2)) == [5]
    with pytest.raises(ValueError, match=r"valid indices are 0\.\.2"):
        RouterConfig(block_size=2, skippable_blocks=[3]).layout(6)
    with pytest.raises(ValueError, match="block_starts"):
        RouterConfig(block_starts=[1, 3]).layout(6)
    with pytest.raises(ValueError, match="unknown RouterConfig field"):
        RouterConfig.from_dict({"block_sise": 2})
    # Blocks of several layers are exact at init too.
    assert check_identity(model, tiny_inputs(processor), RouterConfig(block_starts=[0, 1, 4])) <= 1e-4


def test_router_parameters_are_under_one_percent_of_a_realistic_backbone():
    # SmolLM2-135M dimensions (the language half of SmolVLM-256M), built without weights on the meta device.
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    for router_config in (RouterConfig(block_size=1, skip_gate=True), RouterConfig(block_size=1)):
        adapter = attach_routers(model, router_config)
        trainable = sum(p.numel() for p in adapter.parameters() if p.requires_grad)
        adapter.detach()
        assert 0 < trainable < 0.01 * total, (trainable, total)
        assert trainable < 0.001 * total  # in fact well under 0.1 %: ~36k (+gates ~33k) of 135M


def test_a_spec_that_misses_the_decoder_parts_names_the_field_to_fix():
    model, _ = tiny_vlm("llava")
    with pytest.raises(TypeError, match=r"has no 'blocks' \(the decoder layers\).*BackboneSpec\(layers_attr=.*decoder="):
        BackboneSpec(layers_attr="blocks").get_layers(model)
    with pytest.raises(TypeError, match=r"has no 'ln_f' \(the final norm\).*final_norm_attr"):
        BackboneSpec(final_norm_attr="ln_f").get_final_norm(model)


def test_a_fine_tune_that_differs_only_in_its_projections_is_another_base():
    # A merged LoRA changes only projections: the fingerprint read embeddings, norms and the head, and took it.
    model, _ = tiny_vlm("qwen2_vl")
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        for layer in resolve(tuned).get_layers(tuned):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.add_(0.05)
    with pytest.raises(AdapterMismatchError, match="other weights.*first_k_proj"):
        check_fingerprint(base_fingerprint(model), base_fingerprint(tuned), source="adapter", projections=True)
    # Where the model may hold its own merged LoRA (routers attached after `merge_and_unload`) they are not read.
    check_fingerprint(base_fingerprint(model), base_fingerprint(tuned), source="adapter")
    older = base_fingerprint(model)  # an adapter saved before projections were sampled still loads
    del older["projection_samples"]
    check_fingerprint(older, base_fingerprint(model), source="adapter", projections=True)


def test_a_failed_skip_check_describes_what_the_kv_path_ran_per_layer_even_beside_layers_without_attention():
    from vlm_retrofit.skipping.consistency import _kv_path

    model = ToyForCausalLM(ToyConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    del model.model.layers[0].self_attn  # as a hybrid's convolution layer, listed in never_skip_layers
    register_backbone("toy_llama", BackboneSpec())
    try:
        described = _kv_path(model)
    finally:
        unregister_backbone("toy_llama")
    assert described.startswith("layer 0: no kv-only path; layer 1: LlamaRMSNorm, no key norm, apply_rotary_pos_emb")


def test_a_spec_with_values_where_functions_belong_or_layers_out_of_range_is_refused_where_it_is_made():
    # Before: "'tuple' object is not callable" deep inside routing, a config class taken as a key (then every
    # "unsupported family" message crashed sorting the keys), and out-of-range never-skip layers dropped silently.
    with pytest.raises(TypeError, match=r"never_skip_layers=\.\.\.\) takes a function of the config, got tuple "
                                        r"\(0, 1\): e.g. never_skip_layers=lambda config: \(0, 1\)"):
        BackboneSpec(never_skip_layers=(0, 1))
    with pytest.raises(TypeError, match=r"decoder=\.\.\.\) takes a function of the model"):
        BackboneSpec(decoder="model")
    with pytest.raises(TypeError, match=r"layers_attr=\.\.\.\) takes an attribute name"):
        BackboneSpec(layers_attr=None)
    with pytest.raises(TypeError, match="model_type, a str .*'toy_llama'"):
        register_backbone(ToyConfig, BackboneSpec())
    model = ToyForCausalLM(ToyConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    register_backbone("toy_llama", BackboneSpec(never_skip_layers=lambda config: [9]))
    try:
        with pytest.raises(ValueError, match=r"feature_injection_layers name layer\(s\) \[9\], but this backbone has 5"):
            attach_routers(model, RouterConfig())
        assert get_adapter(model) is None
    finally:
        unregister_backbone("toy_llama")
