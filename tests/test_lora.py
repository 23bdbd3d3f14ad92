"""Routers and a `peft` LoRA on the same backbone: either order, save/reload, and LoRA merging."""

import re

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from vlm_retrofit import AdapterMismatchError, RouterAdapter, RouterConfig, attach_routers, get_adapter
from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm

# Text attention projections only: the vision towers of some families name theirs differently.
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _lora(model):
    torch.manual_seed(7)  # init_lora_weights=False draws both LoRA matrices at random: seed them
    return get_peft_model(model, LoraConfig(**LORA))


def _set_routers(adapter):
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for router in adapter.routers.values():
            router.query.copy_(torch.randn(router.query.shape, generator=generator))


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_and_routers_in_either_order(family, tmp_path):
    base, processor = tiny_vlm(family)
    inputs = tiny_inputs(processor)
    plain = _logits(base, inputs)

    lora_first = _lora(tiny_vlm(family)[0])
    adapter_a = attach_routers(lora_first, RouterConfig())
    assert torch.allclose(_logits(lora_first, inputs), _logits_lora_only(family, inputs), atol=1e-4)
    _set_routers(adapter_a)
    out_a = _logits(lora_first, inputs)
    # LoRA stays trainable next to the routers; the backbone stays frozen.
    trainable = {n for n, p in lora_first.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    routers_first = tiny_vlm(family)[0]
    adapter_b = attach_routers(routers_first, RouterConfig())
    _set_routers(adapter_b)
    routers_first = _lora(routers_first)
    out_b = _logits(routers_first, inputs)
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=0)
    assert (out_a - plain).abs().max() > 1e-3

    # Both halves reload exactly on a fresh base, and survive merging the LoRA into the weights.
    lora_first.save_pretrained(tmp_path / "lora")
    adapter_a.save_pretrained(tmp_path / "routers")
    fresh = PeftModel.from_pretrained(tiny_vlm(family)[0], tmp_path / "lora")
    restored = RouterAdapter.from_pretrained(fresh, tmp_path / "routers")
    torch.testing.assert_close(_logits(fresh, inputs), out_a, atol=1e-5, rtol=0)
    restored.detach()
    merged = fresh.merge_and_unload()
    restored = RouterAdapter.from_pretrained(merged, tmp_path / "routers")
    torch.testing.assert_close(_logits(merged, inputs), out_a, atol=1e-4, rtol=0)
    # The routers alone onto the plain base would route another model: refused (before: loaded silently).
    with pytest.raises(AdapterMismatchError, match="saved on a model with a PEFT adapter"):
        RouterAdapter.from_pretrained(tiny_vlm(family)[0], tmp_path / "routers")


def _logits_lora_only(family, inputs):
    return _logits(_lora(tiny_vlm(family)[0]), inputs)


def test_merging_the_lora_keeps_the_routers_when_it_trained_the_final_norm(tmp_path):
    # modules_to_save puts the trained copy of the final norm in place of its wrapper on merge: the final router's
    # hook sat on that wrapper, and a plain merge_and_unload dropped it.
    model, processor = tiny_vlm("llama")
    torch.manual_seed(7)
    model = get_peft_model(model, LoraConfig(**LORA, modules_to_save=["norm"]))
    final_norm = model.base_model.model.model.norm
    with torch.no_grad():
        final_norm.modules_to_save["default"].weight.mul_(1.5)
    adapter = attach_routers(model, RouterConfig())
    _set_routers(adapter)
    inputs = tiny_inputs(processor)
    expected = _logits(model, inputs)
    adapter.save_pretrained(tmp_path / "routers")
    merged = adapter.merge_lora()
    assert adapter.model is merged and get_adapter(merged) is adapter and not hasattr(merged, "peft_config")
    torch.testing.assert_close(_logits(merged, inputs), expected, atol=1e-5, rtol=0)
    adapter.detach()
    assert (_logits(merged, inputs) - expected).abs().max() > 1e-3  # the final router matters here
    # Saved routers load onto such a merged model only when checked against the base they were trained on.
    with pytest.raises(AdapterMismatchError, match="final_norm"):
        RouterAdapter.from_pretrained(merged, tmp_path / "routers")
    restored = RouterAdapter.from_pretrained(merged, tmp_path / "routers", base=tiny_vlm("llama")[0])
    torch.testing.assert_close(_logits(merged, inputs), expected, atol=1e-5, rtol=0)
    assert restored.fingerprint == adapter.fingerprint


@pytest.mark.parametrize("family, targets, missing", [("llama", ["q_proj", "o_prj"], "['o_prj']"),
                                                      ("qwen3_vl_moe", ["q_proj", "down_proj"], "['down_proj']")])
def test_lora_target_names_no_module_has_are_refused_not_dropped(family, targets, missing):
    # PEFT adapts the names it finds and drops the others silently: a typo, or an expert projection that a mixture
    # of experts keeps as a parameter, would train a LoRA without them.
    from vlm_retrofit.errors import InputError
    from vlm_retrofit.training import RetrofitModule

    with pytest.raises(InputError, match=re.escape(f"lora.target_modules names {missing}, which no module")):
        RetrofitModule(backbone=f"tiny:{family}", lora={"r": 2, "target_modules": targets}, train_routers=False,
                       max_removed_blocks=1, removal_order=[2], max_drop_rate=0.0)
    model, _ = tiny_vlm(family)
    full_names = [name for name, _ in model.named_modules() if name.endswith("layers.1.self_attn.q_proj")]
    module = RetrofitModule(backbone=f"tiny:{family}", lora={"r": 2, "target_modules": full_names + ["v_proj"]},
                            train_routers=False, max_removed_blocks=1, removal_order=[2], max_drop_rate=0.0)
    assert module._lora_layers  # whole names and last parts, as PEFT matches them, are found
