"""Routers and a `peft` LoRA on the same backbone: either order, save/reload, and LoRA merging."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from vlm_retrofit import RouterAdapter, RouterConfig, attach_routers
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


def _logits_lora_only(family, inputs):
    return _logits(_lora(tiny_vlm(family)[0]), inputs)
