"""Formatting with real (tiny) processors: image tokens expanded, loss mask = response tokens, sample decoding."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_retrofit.datamodules import ChatFormatter, Example, load_processor, model_inputs
from vlm_retrofit.datamodules.samples import Skip, decode_image, parse_conversation, parse_text, to_rgb
from vlm_retrofit.testing import FAMILIES, tiny_vlm

# What the template puts after the assistant content (part of the loss; trailing whitespace is not).
END_OF_TURN = {"qwen2_vl": "<|im_end|>", "llava": "", "smolvlm": "<end_of_utterance>"}
CAPTIONS = ["A red square at the top left.", "Three blue circles in a row and a green triangle."]


@pytest.fixture(scope="module", params=sorted(END_OF_TURN))
def tiny(request):
    model, processor = tiny_vlm(request.param)
    return request.param, model, ChatFormatter(processor, max_length=512)


def _examples():
    imgs = [Image.new("RGB", (60, 40), (200, 0, 0)), Image.new("RGB", (30, 70), (0, 0, 200))]
    exs = [Example(f"img{i}", "s.tar", [("user", "Describe the image."), ("assistant", c)], im)
           for i, (c, im) in enumerate(zip(CAPTIONS, imgs))]
    exs.insert(1, Example("txt", "s.tar", [("user", "What is 2 plus 3?"), ("assistant", "2 plus 3 is 5.")]))
    return exs


def _response(fmt, batch, i):
    """Tokens the loss mask selects for row i: input_ids[:, 1:][loss_mask[:, :-1]]."""
    return fmt.tokenizer.decode(batch["input_ids"][i, 1:][batch["loss_mask"][i, :-1]])


def test_mixed_batch_image_tokens_and_loss_mask(tiny):
    family, model, fmt = tiny
    exs = _examples()
    batch, rejected = fmt.collate(exs)
    assert not rejected and fmt.can_mix
    image_id = fmt.processor.image_token_id
    per_row = (batch["input_ids"] == image_id).sum(1).tolist()
    assert per_row[1] == 0 and per_row[0] > 1 and per_row[2] > 1  # placeholders expanded, text row has none
    answers = [c for c in (CAPTIONS[0], "2 plus 3 is 5.", CAPTIONS[1])]
    for i, answer in enumerate(answers):
        assert _response(fmt, batch, i).strip() == answer + END_OF_TURN[family]
    att, mask = batch["attention_mask"].bool(), batch["loss_mask"]
    lengths = att.sum(1)
    for i, n in enumerate(lengths.tolist()):  # right padding: real tokens first
        assert att[i, :n].all() and not att[i, n:].any()
    assert not mask[:, -1].any() and not (mask & ~att).any()
    inputs = model_inputs(batch)
    assert set(inputs) == set(batch) - {"loss_mask"}
    with torch.no_grad():
        logits = model(**inputs).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][mask[:, :-1]], batch["input_ids"][:, 1:][mask[:, :-1]])
    assert torch.isfinite(loss)


def test_multi_turn_masks_every_assistant_turn(tiny):
    family, _, fmt = tiny
    turns, image = parse_conversation([
        {"from": "human", "value": "<image>\nWhat colour is it?"}, {"from": "gpt", "value": "Red."},
        {"from": "human", "value": "And the shape?"}, {"from": "gpt", "value": "A square."},
        {"from": "human", "value": "dangling question without answer"}])
    assert image and turns[0] == ("user", "What colour is it?") and len(turns) == 4
    ex = Example("conv", "s.tar", turns, Image.new("RGB", (40, 40), (255, 0, 0)))
    batch, _ = fmt.collate([ex])
    eot = END_OF_TURN[family]
    assert _response(fmt, batch, 0).replace(" ", "") == f"Red.{eot}Asquare.{eot}"


def test_truncation_and_too_long(tiny):
    family, _, fmt = tiny
    exs = _examples()
    full, _ = fmt.collate(exs)
    prompt_len = int((full["loss_mask"][0].nonzero()[0]))  # position predicting the first response token
    fmt.max_length = prompt_len + 3
    try:
        batch, rejected = fmt.collate(exs)
        assert batch["input_ids"].shape[1] == prompt_len + 3
        kept = {ex.key for ex in exs} - {ex.key for ex, _, _ in rejected}
        assert all(reason == "too_long" for _, reason, _ in rejected) and "img0" in kept
        assert 1 <= int(batch["loss_mask"][0].sum()) <= 2  # the start of the caption only
        fmt.max_length = 4
        batch, rejected = fmt.collate(exs)
        assert batch is None and [r for _, r, _ in rejected] == ["too_long"] * 3
    finally:
        fmt.max_length = 512


def test_processor_failure_rejects_only_that_sample():
    fmt = ChatFormatter(load_processor("tiny:qwen2_vl"))
    exs = _examples()
    exs[1].image = Image.new("RGB", (2, 600))  # Qwen2-VL refuses aspect ratios beyond 200
    exs[1].turns = [("user", "Describe the image."), ("assistant", "A thin line.")]
    batch, rejected = fmt.collate(exs)
    assert [(ex.key, r) for ex, r, _ in rejected] == [("txt", "format_error")]
    assert batch["input_ids"].shape[0] == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_batch_runs_forward(family):
    model, processor = tiny_vlm(family)
    fmt = ChatFormatter(processor, max_length=512)
    exs = _examples() if fmt.can_mix else [e for e in _examples() if e.image is not None]
    batch, rejected = fmt.collate(exs)
    assert not rejected and batch["loss_mask"].sum(1).gt(0).all()
    for i, ex in enumerate(exs):
        assert ex.turns[-1][1] in _response(fmt, batch, i)
    with torch.no_grad():
        assert model(**model_inputs(batch)).logits.shape[:2] == batch["input_ids"].shape


def test_load_processor_from_a_local_folder(tmp_path):
    _, processor = tiny_vlm("llava")
    processor.save_pretrained(tmp_path / "llava")
    loaded = load_processor(str(tmp_path / "llava"))
    assert type(loaded).__name__ == "LlavaProcessor"
    _, tok = tiny_vlm("qwen2")
    tok.save_pretrained(tmp_path / "lm")
    batch, _ = ChatFormatter(load_processor(str(tmp_path / "lm"))).collate(_examples())
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}  # images dropped, text kept


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # PaliGemmaProcessor, numpy 2
def test_a_processor_without_a_chat_template_is_refused_naming_where_it_came_from(tmp_path):
    from vlm_retrofit.datamodules import WebDatasetDataModule
    from vlm_retrofit.errors import InputError

    _, processor = tiny_vlm("qwen2_vl")
    processor.chat_template = processor.tokenizer.chat_template = None
    with pytest.raises(InputError, match="processor of my/backbone has no chat template.*chat_template.jinja"):
        ChatFormatter(processor, source="my/backbone")
    processor.save_pretrained(tmp_path / "base")  # a folder without chat_template.jinja
    data = WebDatasetDataModule(processor=str(tmp_path / "base"), synthetic_samples=16)
    with pytest.raises(InputError, match=f"processor of {tmp_path / 'base'} has no chat template"):
        data.setup("fit")
    _, tokenizer = tiny_vlm("qwen2")  # a text-only LM: the template sits on the tokenizer
    tokenizer.chat_template = None
    with pytest.raises(InputError, match="no chat template"):
        ChatFormatter(tokenizer)
    # PaliGemma's processor formats a prompt and a suffix, no chat turns: it needs no template.
    _, paligemma = tiny_vlm("paligemma")
    paligemma.chat_template = paligemma.tokenizer.chat_template = None
    batch, rejected = ChatFormatter(paligemma).collate(_examples()[:1])
    assert batch is not None and not rejected


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_odd_image_modes_are_converted():
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # fully transparent red -> white
    assert to_rgb(rgba).getpixel((0, 0)) == (255, 255, 255)
    pal = Image.new("P", (8, 8), 1)
    pal.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    assert to_rgb(pal).getpixel((0, 0)) == (10, 20, 30)
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))
    assert to_rgb(cmyk).getpixel((0, 0)) == (255, 0, 0)
    assert to_rgb(Image.new("L", (8, 8), 77)).getpixel((0, 0)) == (77, 77, 77)
    deep = Image.fromarray(np.full((8, 8), 65535, dtype=np.uint16))
    assert to_rgb(deep).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.new("1", (8, 8), 1)).mode == "RGB"


def test_image_size_limits():
    big = _png(Image.new("RGB", (400, 100), (1, 2, 3)))
    assert decode_image(big, max_image_pixels=50_000, max_image_side=64).size == (64, 16)  # downscaled
    with pytest.raises(Skip) as e:
        decode_image(big, max_image_pixels=10_000, max_image_side=64)
    assert e.value.reason == "huge_image"
    with pytest.raises(Skip) as e:
        decode_image(big[: len(big) // 2], 10**8, 4096)
    assert e.value.reason == "corrupt_image"


def test_text_payloads():
    assert parse_text("txt", b"  a cat \n", "Describe.") == ([("user", "Describe."), ("assistant", "a cat")], True,
                                                           True)
    turns, needs_image, _ = parse_text("json", json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello"}]}).encode(), "P")
    assert turns == [("user", "Hi"), ("assistant", "Hello")] and not needs_image
    assert parse_text("json", b'{"caption": "x"}', "P")[1]
    for payload, reason in ((b"", "empty_text"), (b"{", "bad_json"), (b'{"foo": 1}', "bad_json"),
                            (b'[{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]',
                             "empty_text"), (b'[{"role": "robot", "content": "q"}]', "bad_json")):
        with pytest.raises(Skip) as e:
            parse_text("json" if payload[:1] in (b"{", b"[") else "txt", payload, "P")
        assert e.value.reason == reason
