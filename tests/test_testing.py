"""Tests for vlm_retrofit.testing: tiny offline models, processors and inputs for every family."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import time

import pytest
import torch
import transformers

from vlm_retrofit.testing import FAMILIES, tiny_inputs, tiny_vlm

TEXT_ONLY = {"llama", "qwen2"}
VLMS = [f for f in FAMILIES if f not in TEXT_ONLY]


def _vocab(model):
    return model.config.get_text_config().vocab_size


def test_families_are_model_types():
    assert len(FAMILIES) == 22 and len(set(FAMILIES)) == 22
    assert FAMILIES[-2:] == ("llama", "qwen2")


@pytest.mark.parametrize("family", FAMILIES)
def test_build(family):
    start = time.perf_counter()
    model, processor = tiny_vlm(family)
    elapsed = time.perf_counter() - start
    print(f"{family}: built in {elapsed:.3f} s")  # well under 2 s; a wall-clock bound would fail on a loaded machine
    assert model.config.model_type == family
    assert not any(m.training for m in model.modules())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config._attn_implementation == "eager"
    assert len(model.get_decoder().layers) == 4
    tokenizer = getattr(processor, "tokenizer", processor)
    assert _vocab(model) == len(tokenizer)
    assert tokenizer.chat_template and tokenizer.padding_side == "left"
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id is not None
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id is not None
    if family in TEXT_ONLY:
        assert isinstance(processor, transformers.PreTrainedTokenizerBase)
        assert type(model).__name__.endswith("ForCausalLM")
    else:
        assert isinstance(processor, transformers.ProcessorMixin)
        assert hasattr(processor, "image_processor")
        assert type(model).__name__.endswith("ForConditionalGeneration")
        assert 0 <= model.config.image_token_id < len(tokenizer)


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_and_rng_untouched(family):
    rng = torch.get_rng_state()
    (m1, p1), (m2, p2) = tiny_vlm(family), tiny_vlm(family)
    assert torch.equal(rng, torch.get_rng_state())
    assert m1 is not m2
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    i1, i2 = tiny_inputs(p1), tiny_inputs(p2)
    assert i1.keys() == i2.keys()
    assert all(torch.equal(i1[k], i2[k]) for k in i1)


def test_processor_copies_are_independent():
    _, p1 = tiny_vlm("qwen2_vl")
    p1.tokenizer.padding_side = "right"
    p1.tokenizer.add_tokens(["<scratch>"])
    _, p2 = tiny_vlm("qwen2_vl")
    assert p2.tokenizer.padding_side == "left"
    assert len(p2.tokenizer) == len(p1.tokenizer) - 1


@pytest.mark.parametrize("with_image", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_generate(family, with_image):
    model, processor = tiny_vlm(family)
    inputs = tiny_inputs(processor, with_image=with_image)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape[0] == 2 and mask.shape == ids.shape
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 1).all()  # left padding really occurs
    if family not in TEXT_ONLY:
        n_image = (ids == model.config.image_token_id).sum(dim=1)
        if with_image:
            assert (n_image > 0).all() and "pixel_values" in inputs
            assert n_image[0] == n_image[1]  # one same-size image per sample
        else:
            assert (n_image == 0).all() and "pixel_values" not in inputs
    if family.startswith("qwen") and family != "qwen2":
        assert "mm_token_type_ids" in inputs
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (2, ids.shape[1], _vocab(model))
    assert torch.isfinite(logits).all()
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert ids.shape[1] < out.shape[1] <= ids.shape[1] + 3
    assert torch.equal(out[:, : ids.shape[1]], ids)


@pytest.mark.parametrize("family", VLMS)
def test_images_differ_per_sample(family):
    _, processor = tiny_vlm(family)
    pixels = tiny_inputs(processor, batch=2)["pixel_values"]
    if family.startswith("qwen") or family == "glm4v":  # flattened patches of both images, split in halves
        a, b = pixels.chunk(2)
    else:
        a, b = pixels[0], pixels[1]
    assert not torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "gemma3", "llama"])
def test_batch_sizes(family):
    model, processor = tiny_vlm(family)
    for batch in (1, 5):
        inputs = tiny_inputs(processor, batch=batch)
        assert inputs["input_ids"].shape[0] == batch
        if batch > 1:  # strictly increasing prompt lengths: every row but the last is padded
            assert (inputs["attention_mask"][:-1, 0] == 0).all()
        with torch.no_grad():
            assert torch.isfinite(model(**inputs).logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_overrides_apply_to_text_config(family):
    model, processor = tiny_vlm(family, num_hidden_layers=6, hidden_size=96)
    decoder = model.get_decoder()
    assert len(decoder.layers) == 6
    assert model.config.get_text_config().hidden_size == 96
    assert decoder.embed_tokens.weight.shape[1] == 96
    with torch.no_grad():
        logits = model(**tiny_inputs(processor)).logits
    assert torch.isfinite(logits).all()
    default, _ = tiny_vlm(family)
    assert len(default.get_decoder().layers) == 4  # the override did not leak into the cache


def test_qwen3_vl_deepstack_is_active():
    model, processor = tiny_vlm("qwen3_vl")
    indexes = model.config.vision_config.deepstack_visual_indexes
    assert len(indexes) > 0 and len(model.model.visual.deepstack_merger_list) == len(indexes)
    inputs = tiny_inputs(processor)
    with torch.no_grad():
        before = model(**inputs).logits
        for p in model.model.visual.deepstack_merger_list.parameters():
            p.mul_(3.0)
        after = model(**inputs).logits
    assert not torch.allclose(before, after)  # deepstack features reach the decoder


def test_unknown_family_raises():
    with pytest.raises(ValueError, match="qwen2_vl"):
        tiny_vlm("not_a_family")


@pytest.mark.parametrize("family", ["llama", "qwen2_vl", "gemma3"])
def test_unknown_override_raises(family):
    with pytest.raises(TypeError, match="no_such_key"):
        tiny_vlm(family, no_such_key=3)
