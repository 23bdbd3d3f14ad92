"""Release: merge checkpoints and adapters, load without Lightning, verify, atomicity, idempotence, refusals."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from vlm_retrofit import AdapterMismatchError, get_adapter, load_release
from vlm_retrofit.cli import main
from vlm_retrofit.release import load_checkpoint, load_trained, merge
from vlm_retrofit.testing import tiny_inputs

from conftest import fit_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short `fit` of routers + LoRA on tiny LLaVA: its checkpoint and exported adapter folder."""
    run = tmp_path_factory.mktemp("run")
    fit_config(run, "tiny-llava-lora.yaml", "--trainer.max_steps", "3")
    root = run / "runs" / "tiny-llava-lora"
    return root / "checkpoints" / "last.ckpt", root / "adapter"


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _files(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_release_reproduces_the_trained_model(trained, tmp_path):
    checkpoint, _ = trained
    source = load_checkpoint(checkpoint)
    inputs = tiny_inputs(source.processor)
    expected = _logits(source.model, inputs)
    with torch.no_grad(), source.adapter.skipping("random", rate=0.5) as report:
        expected_tokens = source.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert sum(report.block_skipped_tokens) > 0
    source.adapter.detach()
    assert (expected - _logits(source.model, inputs)).abs().max() > 1e-4  # the routers matter

    merge(checkpoint, tmp_path / "release")
    model, processor = load_release(tmp_path / "release")
    torch.testing.assert_close(_logits(model, inputs), expected, atol=1e-5, rtol=0)
    with torch.no_grad(), get_adapter(model).skipping("random", rate=0.5):
        tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, expected_tokens)
    config = json.loads((tmp_path / "release" / "release_config.json").read_text())
    assert config["lora"] == "adapter" and not config["full_weights"]
    assert "Loading" in (tmp_path / "release" / "README.md").read_text()


@pytest.mark.parametrize("options", [{"merge_lora": True}, {"full_weights": True}], ids=["merge-lora", "full-weights"])
def test_merged_lora_equals_unmerged_lora(trained, tmp_path, options):
    _, adapter_dir = trained
    merge(adapter_dir, tmp_path / "lora", verify=False)
    merge(adapter_dir, tmp_path / "merged", **options)
    assert not (tmp_path / "merged" / "lora").exists()
    unmerged, processor = load_release(tmp_path / "lora")
    merged, _ = load_release(tmp_path / "merged")
    inputs = tiny_inputs(processor)
    torch.testing.assert_close(_logits(merged, inputs), _logits(unmerged, inputs), atol=1e-4, rtol=0)
    # fp32 weights: the release reproduces the unmerged model itself, and no merge change is recorded.
    assert "lora_merge_logit_change" not in json.loads((tmp_path / "merged" / "release_config.json").read_text())


@pytest.fixture(scope="module")
def trained_bf16(tmp_path_factory):
    """A short bf16 `fit` (bf16 frozen weights, bf16-mixed steps) whose LoRA also trains every norm (the final one,
    where the final router hooks in, included)."""
    run = tmp_path_factory.mktemp("run_bf16")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": r".*language_model.*\.(q_proj|v_proj)",
            "modules_to_save": ["norm"]}
    fit_config(run, "tiny-llava-lora.yaml", "--trainer.max_steps", "3", "--model.torch_dtype", "bfloat16",
               "--trainer.precision", "bf16-mixed", "--model.lora", json.dumps(lora))
    return run / "runs" / "tiny-llava-lora" / "adapter"


def test_a_lora_merged_into_bf16_weights_reproduces_the_merged_weights_and_records_what_it_changed(
        trained_bf16, tmp_path, capsys):
    merge(trained_bf16, tmp_path / "lora")
    assert main(["merge", "--ckpt", str(trained_bf16), "--output", str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert "changed the sample logits by up to" in capsys.readouterr().out
    merge(trained_bf16, tmp_path / "full", full_weights=True)
    recorded = json.loads((tmp_path / "merged" / "release_config.json").read_text())
    change = recorded["lora_merge_logit_change"]
    assert 0 < change < 0.1  # bf16 rounding of the merged weights, not a lost adapter
    assert "lora_merge_logit_change" not in json.loads((tmp_path / "lora" / "release_config.json").read_text())
    unmerged, processor = load_release(tmp_path / "lora")
    merged, _ = load_release(tmp_path / "merged")
    full, _ = load_release(tmp_path / "full")
    inputs = tiny_inputs(processor)
    torch.testing.assert_close(_logits(full, inputs), _logits(merged, inputs), atol=0, rtol=0)
    assert (_logits(merged, inputs).float() - _logits(unmerged, inputs).float()).abs().max() <= change + 1e-6
    mask = inputs["attention_mask"].bool()
    kept = (_logits(merged, inputs)[mask].argmax(-1) == _logits(unmerged, inputs)[mask].argmax(-1)).float().mean()
    assert recorded["lora_merge_top1_agreement"] == pytest.approx(kept.item())
    # The trained norms are part of the merged weights (the LoRA layers' weights alone would drop them).
    trained_norm = unmerged.base_model.model.model.language_model.layers[0].input_layernorm
    shipped_norm = merged.model.language_model.layers[0].input_layernorm
    assert (trained_norm.modules_to_save["default"].weight - 1).abs().max() > 0
    torch.testing.assert_close(shipped_norm.weight, trained_norm.modules_to_save["default"].weight, atol=0, rtol=0)


def test_a_pruned_bf16_release_is_verified_in_fp32_on_its_own_weights(trained_bf16, tmp_path):
    # The skip machinery's plain-removal reference sums the stream in fp32, the pruned bf16 model in bf16: compared
    # in bf16 the two always differed (0.004 here) and every pruned release of a bf16 run was refused.
    merge(trained_bf16, tmp_path / "pruned", prune_blocks=[1], allow_untrained_removal=True)
    pruned, _ = load_release(tmp_path / "pruned")
    as_fp32, _ = load_release(tmp_path / "pruned", torch_dtype="float32")
    assert pruned.dtype == torch.bfloat16 and as_fp32.dtype == torch.float32
    assert pruned.config.text_config.num_hidden_layers == 4  # the config's 6, less block 1's two layers


def _prompt_token_ids(processor, count=4):
    """Text token ids the merge's sample inputs contain (not padding, not the image placeholder)."""
    inputs = tiny_inputs(processor)
    skip = {processor.tokenizer.pad_token_id, processor.tokenizer.convert_tokens_to_ids(processor.image_token)}
    ids = [i for i in dict.fromkeys(inputs["input_ids"][inputs["attention_mask"].bool()].tolist()) if i not in skip]
    return ids[:count]


@pytest.mark.parametrize("beside, tied", [("modules_to_save", True), ("trainable_tokens", False),
                                          ("trainable_tokens", True)],
                         ids=["tied-head-copy", "token-rows", "token-rows-of-a-tied-head"])
def test_what_peft_trains_beside_the_lora_ships_in_a_merged_release(tmp_path, beside, tied):
    # Before: a trained head copy merged into a tied base was written into the embeddings too (refused as
    # another base), and trained token rows were left out of merged_lora.safetensors (lost, or refused where
    # the head shares them).
    from vlm_retrofit.testing import tiny_vlm

    base, processor = tiny_vlm("llava", num_hidden_layers=6, tie_word_embeddings=tied)
    assert (base.lm_head.weight is base.get_input_embeddings().weight) == tied
    lora = {"r": 4, "lora_alpha": 8, "target_modules": r".*language_model.*\.(q_proj|v_proj)"}
    lora.update({"modules_to_save": ["lm_head"]} if beside == "modules_to_save"
                else {"trainable_token_indices": _prompt_token_ids(processor)})
    fit_config(tmp_path, "tiny-llava-lora.yaml", "--trainer.max_steps", "3", "--model.lora", json.dumps(lora),
               "--model.backbone_kwargs", json.dumps({"num_hidden_layers": 6, "tie_word_embeddings": tied}))
    checkpoint = tmp_path / "runs" / "tiny-llava-lora" / "checkpoints" / "last.ckpt"
    source = load_checkpoint(checkpoint)
    inputs = tiny_inputs(processor)
    expected = _logits(source.model, inputs)
    trained_embeddings = source.model.get_input_embeddings()(torch.arange(len(processor.tokenizer))).detach()
    trained_head = source.model.get_output_embeddings()
    trained_head = trained_head.modules_to_save["default"] if beside == "modules_to_save" else trained_head
    trained_head_weight = trained_head(torch.eye(64)).detach().T  # the head's weight, however PEFT wraps it
    changed = (trained_embeddings != base.get_input_embeddings().weight).any(-1) | \
        (trained_head_weight != base.lm_head.weight).any(-1)
    assert changed.any()  # training moved what PEFT trains beside the LoRA

    merge(checkpoint, tmp_path / "merged", merge_lora=True)
    merge(checkpoint, tmp_path / "full", full_weights=True)
    merge(checkpoint, tmp_path / "pruned", prune_blocks=[1], allow_untrained_removal=True)
    for folder in ("merged", "full", "pruned"):
        model, _ = load_release(tmp_path / folder)
        if folder != "pruned":
            torch.testing.assert_close(_logits(model, inputs), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(model.get_input_embeddings().weight, trained_embeddings, atol=0, rtol=0)
        torch.testing.assert_close(model.lm_head.weight, trained_head_weight, atol=1e-6, rtol=0)
        # One tensor again only where training kept them one (trainable rows of a tied head train both).
        assert (model.lm_head.weight is model.get_input_embeddings().weight) == (tied and beside != "modules_to_save")
    saved = json.loads((tmp_path / "full" / "model" / "config.json").read_text())
    assert saved["text_config"].get("tie_word_embeddings", False) == (tied and beside != "modules_to_save")


def test_a_base_given_as_a_relative_folder_loads_from_anywhere_and_a_moved_one_is_named(tmp_path, monkeypatch):
    from vlm_retrofit.testing import tiny_vlm

    base, processor = tiny_vlm("llava", num_hidden_layers=6)
    base.save_pretrained(tmp_path / "run" / "base")
    processor.save_pretrained(tmp_path / "run" / "base")
    fit_config(tmp_path / "run", "tiny-llava-lora.yaml", "--trainer.max_steps", "2", "--model.backbone", "base",
               "--model.backbone_kwargs", "null")
    root = tmp_path / "run" / "runs" / "tiny-llava-lora"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a relative "base" recorded as given would name nothing here (or a hub id)
    merge(root / "checkpoints" / "last.ckpt", tmp_path / "release")
    model, processor = load_release(tmp_path / "release")
    expected = _logits(model, tiny_inputs(processor))
    assert json.loads((tmp_path / "release" / "release_config.json").read_text())["base_model"]["name"] == \
        str((tmp_path / "run" / "base").resolve())

    (tmp_path / "run" / "base").rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=r"base model folder .* not there .*\(--base, or base="):
        load_release(tmp_path / "release")
    assert main(["generate", "--model", str(tmp_path / "release"), "--prompt", "hi"]) == 1
    model, _ = load_release(tmp_path / "release", base=str(tmp_path / "moved"))
    torch.testing.assert_close(_logits(model, tiny_inputs(processor)), expected, atol=0, rtol=0)


def test_merge_is_idempotent_byte_for_byte(trained, tmp_path):
    checkpoint, _ = trained
    merge(checkpoint, tmp_path / "a", full_weights=True)
    merge(checkpoint, tmp_path / "b", full_weights=True)
    first = _files(tmp_path / "a")
    assert first == _files(tmp_path / "b")
    merge(checkpoint, tmp_path / "a", full_weights=True)  # re-merging in place
    assert _files(tmp_path / "a") == first


def test_an_interrupted_merge_leaves_nothing(trained, tmp_path, monkeypatch):
    checkpoint, _ = trained
    from vlm_retrofit.routing import RouterAdapter

    def crash(self, directory, **_):
        raise KeyboardInterrupt("interrupted while writing the router")

    monkeypatch.setattr(RouterAdapter, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        merge(checkpoint, tmp_path / "release")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_for_another_base_is_refused_naming_both(trained, tmp_path, capsys):
    checkpoint, _ = trained
    with pytest.raises(AdapterMismatchError) as error:
        merge(checkpoint, tmp_path / "release", base="tiny:qwen2_vl")
    assert "tiny:llava" in str(error.value) and "tiny:qwen2_vl" in str(error.value)
    assert not (tmp_path / "release").exists()
    assert main(["merge", "--ckpt", str(checkpoint), "--output", str(tmp_path / "r"), "--base", "tiny:qwen2_vl"]) == 1
    assert "merge refused" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_remote_code_an_adapter_records_runs_only_when_the_caller_allows_it(trained, tmp_path, capsys):
    # A downloaded adapter (or release) that records trust_remote_code must not turn it on by itself.
    adapter = tmp_path / "adapter"
    shutil.copytree(trained[1], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model"]["trust_remote_code"] = True
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code=True.*--trust-remote-code"):
        load_trained(adapter)
    assert main(["merge", "--ckpt", str(adapter), "--output", str(tmp_path / "refused")]) == 1
    assert "merge refused" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert main(["merge", "--ckpt", str(adapter), "--output", str(tmp_path / "release"), "--trust-remote-code"]) == 0
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_release(tmp_path / "release")  # the release records it too
    model, _ = load_release(tmp_path / "release", trust_remote_code=True)
    assert get_adapter(model) is not None


def test_load_release_does_not_import_lightning(trained, tmp_path):
    checkpoint, _ = trained
    merge(checkpoint, tmp_path / "release")
    code = ("import sys, torch; from vlm_retrofit import load_release, get_adapter\n"
            "from vlm_retrofit.testing import tiny_inputs\n"
            f"model, processor = load_release({str(tmp_path / 'release')!r})\n"
            "with torch.no_grad(), get_adapter(model).skipping('random', rate=0.3):\n"
            "    model.generate(**tiny_inputs(processor), max_new_tokens=2)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_calibrate_merge_generate_commands(trained, tmp_path, capsys):
    from PIL import Image

    _, adapter_dir = trained
    assert main(["calibrate", "--model", str(adapter_dir), "--target-saving", "0.2", "--batches", "2",
                 "--candidates", "1", "--no-skip-image-positions", "--output", str(tmp_path / "calibrated")]) == 0
    assert "reached" in capsys.readouterr().out
    saved = json.loads((tmp_path / "calibrated" / "adapter_config.json").read_text())
    assert "0.2000" in saved["calibration"]["recent_weight"]
    # Restricted to the block cheapest to remove: a threshold for it only, the other blocks always run.
    assert len(saved["calibration"]["recent_weight"]["0.2000"]["thresholds"]) == 1
    assert saved["calibration"]["recent_weight"]["0.2000"]["skip_image_positions"] is False  # image positions run
    assert "token_match" in saved["calibration_metrics"]["recent_weight"]["0.2000"]
    # A complete adapter folder: the LoRA goes with the routers, or the release below would be merged without it.
    assert _files(tmp_path / "calibrated" / "lora") == _files(adapter_dir / "lora")
    assert main(["merge", "--ckpt", str(tmp_path / "calibrated"), "--output", str(tmp_path / "release")]) == 0
    card = (tmp_path / "release" / "README.md").read_text()
    # Beside the calibration batches' figure, what generating saved (it quoted the first only, which overstated it).
    generating = saved["calibration_metrics"]["recent_weight"]["0.2000"]["generation_compute_saved"]
    assert f"| {generating:.3f} |" in card and "compute saved generating" in card
    assert 'skipping("recent_weight", target_saving=0.2)' in card  # the example runs what was calibrated
    assert "| recent_weight | 0.20 layers |" in card
    # Calibrating the release in place quotes the new calibration in its card (it stayed "Not calibrated" / stale),
    # with the unit its target counts and how its skipping was spread over the blocks.
    capsys.readouterr()
    assert main(["calibrate", "--model", str(tmp_path / "release"), "--target-saving", "0.25", "--batches", "2",
                 "--no-skip-image-positions", "--unit", "flops", "--allocation", "shared"]) == 0
    assert "target 25.0 % of decoder-layer FLOPs saved" in capsys.readouterr().out
    assert ("| recent_weight | 0.25 flops, one threshold shared by its blocks |"
            in (tmp_path / "release" / "README.md").read_text())
    released, _ = load_release(tmp_path / "release")
    assert len(set(get_adapter(released).calibration["recent_weight"]["0.2500"]["thresholds"].values())) == 1
    Image.new("RGB", (40, 40), (250, 20, 20)).save(tmp_path / "red.png")
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "release"), "--image", str(tmp_path / "red.png"),
                 "--prompt", "What colour is it?", "--skip-policy", "recent_weight", "--target-saving", "0.2",
                 "--max-new-tokens", "5", "--compare-base"]) == 0
    out = capsys.readouterr().out
    assert "[recent_weight] decoder-block compute saved" in out
    # Beside the unmodified base: its answer, the agreement with it and the decode-speed ratio.
    assert "agreement with the base's answer: " in out and "x the base's tokens/s" in out
    assert main(["generate", "--model", str(tmp_path / "release"), "--prompt", "Hi", "--skip-policy", "recent_weight",
                 "--target-saving", "0.9"]) == 1  # not calibrated for 0.9: refused with the way forward
    assert "calibrate" in capsys.readouterr().err
    # A release stores its calibration in its own router/: an adapter folder elsewhere would lose its merged LoRA.
    assert main(["calibrate", "--model", str(tmp_path / "release"), "--output", str(tmp_path / "elsewhere")]) == 1
    assert "is a release" in capsys.readouterr().err and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("device, message", [("banana", "not a device name torch knows"),
                                             ("cuda:99", "--device cuda:99: torch sees")])
def test_a_device_that_cannot_run_the_model_is_refused_before_loading(trained, capsys, monkeypatch, device, message):
    import vlm_retrofit.commands as commands

    def no_load(*args, **kwargs):
        raise AssertionError("refused too late: the model was being loaded")

    monkeypatch.setattr(commands, "load_trained", no_load)
    _, adapter_dir = trained
    for command in (["generate", "--prompt", "Hi"], ["calibrate"]):
        assert main([*command, "--model", str(adapter_dir), "--device", device]) == 1
        assert message in capsys.readouterr().err


def test_inputs_follow_the_device_and_other_entries_stay():
    from vlm_retrofit.batch import on_device
    from vlm_retrofit.hardware import device_problem

    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long), "skipped": {"corrupt_image": 1}}
    moved = on_device(batch, "meta")
    assert moved["input_ids"].device.type == "meta" and moved["skipped"] == {"corrupt_image": 1}
    assert device_problem("cpu") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generate_and_calibrate_run_on_a_cuda_device(trained, tmp_path, capsys):
    _, adapter_dir = trained
    assert main(["calibrate", "--model", str(adapter_dir), "--target-saving", "0.2", "--batches", "1",
                 "--device", "cuda", "--output", str(tmp_path / "calibrated")]) == 0
    assert main(["generate", "--model", str(tmp_path / "calibrated"), "--prompt", "Hi", "--skip-policy",
                 "recent_weight", "--target-saving", "0.2", "--max-new-tokens", "3", "--device", "cuda",
                 "--compare-base"]) == 0
    assert "agreement with the base's answer: " in capsys.readouterr().out


def test_merge_and_generate_refuse_a_processor_without_a_chat_template_naming_it(trained, tmp_path, capsys,
                                                                                monkeypatch):
    import vlm_retrofit.release as release

    _, adapter_dir = trained
    assert main(["merge", "--ckpt", str(adapter_dir), "--output", str(tmp_path / "release")]) == 0
    processor_dir = tmp_path / "release" / "processor"
    (processor_dir / "chat_template.jinja").unlink()  # a release whose processor lost its template
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "release"), "--prompt", "Hi"]) == 1
    assert f"processor of {processor_dir} has no chat template" in capsys.readouterr().err

    def without_template(*args, **kwargs):
        loaded = load_trained(*args, **kwargs)
        loaded.processor.chat_template = loaded.processor.tokenizer.chat_template = None
        return loaded

    monkeypatch.setattr(release, "load_trained", without_template)  # a base whose processor has none
    assert main(["merge", "--ckpt", str(adapter_dir), "--output", str(tmp_path / "other")]) == 1
    assert "processor of tiny:llava has no chat template" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_merge_and_calibrate_refuse_an_output_that_holds_other_files_or_their_input(trained, tmp_path, capsys):
    # Before: the output folder was replaced whole, whatever it held (the run folder with its checkpoints, or the
    # adapter being merged).
    checkpoint, adapter_dir = trained
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"training state")
    for command in (["merge", "--ckpt", str(checkpoint), "--output", str(run)],
                    ["calibrate", "--model", str(checkpoint), "--output", str(run), "--batches", "1"]):
        assert main(command) == 1
        printed = capsys.readouterr()
        assert "which is not an earlier" in printed.err
        assert (run / "checkpoints" / "last.ckpt").read_bytes() == b"training state"
    copy = tmp_path / "adapter"
    shutil.copytree(adapter_dir, copy)
    # A release written over a trained adapter (another run's) would lose it; an adapter over a release likewise.
    assert main(["merge", "--ckpt", str(checkpoint), "--output", str(copy)]) == 1
    assert f"{copy} is an adapter folder: writing this release would replace it whole" in capsys.readouterr().err
    merge(checkpoint, tmp_path / "a-release")
    assert main(["calibrate", "--model", str(checkpoint), "--output", str(tmp_path / "a-release"), "--batches",
                 "1"]) == 1
    assert "is a release folder: writing this adapter would replace it" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds the input"):
        merge(copy, copy)
    with pytest.raises(ValueError, match="holds the input"):
        merge(copy, tmp_path)
    assert (copy / "adapter_config.json").is_file()
    merge(checkpoint, tmp_path / "release")
    merge(checkpoint, tmp_path / "release")  # an earlier release is replaced, as before
    merge(checkpoint, tmp_path / "merged", merge_lora=True)
    with pytest.raises(ValueError, match="LoRA is merged into its weights"):
        merge(tmp_path / "merged", tmp_path / "again")


def test_a_base_that_differs_from_the_trained_one_only_in_its_projections_is_refused(trained, tmp_path):
    # A fine-tune of the base (a merged LoRA) differs only in its projections: the fingerprint read embeddings,
    # norms and the head, and every loader took it as the base.
    from vlm_retrofit.backbones import resolve
    from vlm_retrofit.testing import tiny_vlm

    checkpoint, adapter_dir = trained
    model, processor = tiny_vlm("llava", num_hidden_layers=6)  # the base tiny-llava-lora.yaml trains
    with torch.no_grad():
        for layer in resolve(model).get_layers(model):
            layer.self_attn.v_proj.weight.mul_(1.5)
    model.save_pretrained(tmp_path / "fine-tune")
    processor.save_pretrained(tmp_path / "fine-tune")
    merge(adapter_dir, tmp_path / "release", merge_lora=True)
    for load in (lambda: load_checkpoint(checkpoint, base=str(tmp_path / "fine-tune")),
                 lambda: load_trained(adapter_dir, base=str(tmp_path / "fine-tune")),
                 lambda: load_release(tmp_path / "release", base=str(tmp_path / "fine-tune"))):
        with pytest.raises(AdapterMismatchError, match="other weights.*first_v_proj"):
            load()
    load_release(tmp_path / "release")  # its own base, with the LoRA merged into the projections, still loads


def test_written_files_are_as_readable_as_the_umask_makes_any_file(trained, tmp_path):
    # mkstemp's private 0600 stayed on the adapter's files: another user or a serving container could not read them.
    checkpoint, _ = trained
    previous = os.umask(0o022)
    try:
        merge(checkpoint, tmp_path / "release")
    finally:
        os.umask(previous)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777
             for p in (tmp_path / "release").rglob("*") if p.is_file()}
    assert modes["release/router/adapter_model.safetensors"] == 0o644
    assert set(modes.values()) == {0o644}, modes


def test_an_incomplete_damaged_or_foreign_release_is_refused_naming_the_file_before_loading(trained, tmp_path, capsys):
    # Before: a release without its LoRA file loaded as the base without the LoRA, silently; a truncated weights
    # file or a missing folder failed inside safetensors / the hub client naming neither.
    _, adapter_dir = trained
    for name, options in {"adapter": {}, "merged": {"merge_lora": True}, "full": {"full_weights": True}}.items():
        merge(adapter_dir, tmp_path / name, verify=False, **options)
    damaged = {"adapter": ["lora/adapter_model.safetensors", "router/adapter_model.safetensors", "processor"],
               "merged": ["merged_lora.safetensors"], "full": ["model/config.json"]}
    for name, removed in damaged.items():
        for part in removed:
            broken = tmp_path / f"{name}-without-{part.replace('/', '-')}"
            shutil.copytree(tmp_path / name, broken)
            (shutil.rmtree if (broken / part).is_dir() else os.unlink)(broken / part)
            with pytest.raises(FileNotFoundError, match=rf"incomplete: {part} missing"):
                load_release(broken)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    weights = next((cut / "model").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(FileNotFoundError, match=rf"model/{weights.name} is damaged"):
        load_release(cut)
    assert main(["generate", "--model", str(cut), "--prompt", "hi"]) == 1  # one line, no traceback
    assert "is damaged" in capsys.readouterr().err
    newer = tmp_path / "newer"
    shutil.copytree(tmp_path / "adapter", newer)
    config = json.loads((newer / "release_config.json").read_text())
    (newer / "release_config.json").write_text(json.dumps({**config, "format_version": 2}))
    with pytest.raises(AdapterMismatchError, match="release format 2, newer than this vlm_retrofit reads"):
        load_release(newer)
    with pytest.raises(AdapterMismatchError, match="carries its own full weights .* Drop --base"):
        load_release(tmp_path / "full", base="tiny:qwen2_vl")
    load_release(tmp_path / "adapter")  # the intact ones load


def test_an_adapter_folder_copied_without_its_lora_is_refused_and_calibrating_it_keeps_the_record(trained, tmp_path):
    # Before: an adapter folder copied without `lora/` loaded as the routers alone on the base, silently: another model.
    from vlm_retrofit.release import load_adapter_folder

    _, adapter_dir = trained
    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert saved["companions"] == ["lora/adapter_config.json", "lora/adapter_model.safetensors"]
    copy = tmp_path / "copy"
    shutil.copytree(adapter_dir, copy)
    assert main(["calibrate", "--model", str(copy), "--policy", "random", "--target-saving", "0.2",
                 "--batches", "1"]) == 0  # in place: the record survives the rewrite of adapter_config.json
    assert json.loads((copy / "adapter_config.json").read_text())["companions"] == saved["companions"]
    shutil.rmtree(copy / "lora")
    with pytest.raises(FileNotFoundError, match="incomplete: lora/adapter_config.json, lora/adapter_model.safetensors "
                                                "missing"):
        load_adapter_folder(copy)
    assert load_adapter_folder(adapter_dir).lora is not None


def test_calibrate_on_shards_without_a_usable_sample_names_them_in_one_line(trained, tmp_path, capsys):
    from PIL import Image

    from vlm_retrofit.datamodules import write_tar

    image = tmp_path / "x.png"
    Image.new("RGB", (32, 24), (200, 10, 10)).save(image)
    write_tar(tmp_path / "bad.tar", [(f"s{i}", {"png": image.read_bytes(), "txt": b"  "}) for i in range(3)])
    _, adapter_dir = trained
    assert main(["calibrate", "--model", str(adapter_dir), "--shards", str(tmp_path / "bad.tar"),
                 "--output", str(tmp_path / "calibrated")]) == 1
    assert f"calibrate refused: --shards {tmp_path / 'bad.tar'}: val_shards yielded no batch" in capsys.readouterr().err


def test_a_lora_on_a_mixtures_stacked_experts_merges_and_prunes(tmp_path):
    # PEFT's `target_parameters` adapts a parameter, not a module (Qwen3-VL-MoE keeps its experts' projections
    # stacked in one): the merged weights' names were those of a module's `.weight`, and merging failed with KeyError.
    from vlm_retrofit.training import RetrofitModule

    lora = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}  # two: nested wrappers
    module = RetrofitModule(backbone="tiny:qwen3_vl_moe", lora=lora, train_routers=False, max_removed_blocks=1,
                            removal_order=[2], max_drop_rate=0.0, use_gates=False)
    with torch.no_grad():
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # a LoRA that acts
    module.save_adapter(tmp_path / "adapter")
    merge(tmp_path / "adapter", tmp_path / "lora")
    merge(tmp_path / "adapter", tmp_path / "merged", merge_lora=True)  # verified against the unmerged model
    assert json.loads((tmp_path / "merged" / "release_config.json").read_text())["lora"] == "merged"
    merge(tmp_path / "adapter", tmp_path / "pruned", prune_target=0.25)
    unmerged, processor = load_release(tmp_path / "lora")
    merged, _ = load_release(tmp_path / "merged")
    inputs = tiny_inputs(processor)
    torch.testing.assert_close(_logits(merged, inputs), _logits(unmerged, inputs), atol=1e-4, rtol=0)
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "merged" / "merged_lora.safetensors"))
    assert {"model.language_model.layers.0.mlp.experts.gate_up_proj",
            "model.language_model.layers.0.mlp.experts.down_proj"} <= set(written)
