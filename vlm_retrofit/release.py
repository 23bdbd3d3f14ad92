"""Release: merge a trained router adapter into a folder that ships, and load it back without Lightning."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .backbones import base_fingerprint, unchanged_fingerprint, unwrap_model
from .backbones.loading import (RELEASE_CONFIG, floating_dtype, half_precision, load_backbone, load_processor,
                                looks_like_a_folder, require_chat_template)
from .backbones.tied import record_untied_embeddings, untie, with_tied_partners
from .errors import InputError
from .files import LORA_FILES, atomic_write, check_complete, check_replaceable, staged_folder
from .routing import AdapterMismatchError, RouterAdapter, RouterConfig, attach_routers, check_fingerprint
from .replacement import load_replacements
from .routing.adapter import CONFIG_NAME, WEIGHTS_NAME, check_layout, read_adapter_config

RELEASE_FORMAT = "vlm_retrofit.release"
RELEASE_FORMAT_VERSION = 1
"""The newest release layout this code reads and the one it writes."""
CHECKPOINT_SECTION = "vlm_retrofit"  # the training module's checkpoint key (not imported: it pulls in Lightning)
MERGED_LORA = "merged_lora.safetensors"
VERIFY_ATOL = 1e-4


class ReleaseVerificationError(RuntimeError):
    """A freshly written release does not reproduce the model it was merged from."""


@dataclass
class Loaded:
    """A base model with its trained routers (and LoRA, if any), from a checkpoint, adapter folder or release."""

    model: nn.Module
    processor: Any
    adapter: RouterAdapter | None
    """None for a pruned release: its removed layers are gone from the weights and its routers were dropped."""
    base_model: dict[str, Any]
    lora: dict[str, Any] | None
    kind: str
    replacement: tuple[dict[int, torch.Tensor], list[int]] | None = None
    """A replacement of removed layers (linear maps, `vlm_retrofit.replacement`, or layer replacements,
    `vlm_retrofit.layer_replacement`) and the layers it was fitted for."""


def _load_kwargs(base_model: dict[str, Any], source: str, trust_remote_code: bool) -> dict[str, Any]:
    """How to load the base a checkpoint, adapter or release records. Remote code it records runs only when the
    caller allows it too: the file alone cannot turn it on (a downloaded adapter would run its base's code)."""
    if base_model.get("trust_remote_code") and not trust_remote_code:
        raise InputError(f"{source} loads its base model {base_model.get('name')!r} with trust_remote_code=True: "
                         "Python code from that model's folder or hub repository would run. If you trust it, pass "
                         "trust_remote_code=True (--trust-remote-code on the command line)")
    known = ("trust_remote_code", "torch_dtype", "attn_implementation", "model_class", "kwargs")
    return {k: base_model[k] for k in known if base_model.get(k) is not None}


def _load_base(base_model: dict[str, Any], base: str | None, source: str, trust_remote_code: bool = False,
               torch_dtype: str | None = None) -> tuple[nn.Module, Any, dict[str, Any]]:
    base_model = dict(base_model)
    if torch_dtype is not None:  # loads in another dtype than recorded (the fingerprint reads any of them alike)
        base_model["torch_dtype"] = torch_dtype
    if base is not None:
        if str(base_model.get("name", "")).startswith("tiny:") and not base.startswith("tiny:"):
            base_model["kwargs"] = None  # tiny_vlm's config overrides, not from_pretrained arguments
        base_model["name"] = base
    if not base_model.get("name"):
        raise InputError(f"{source} does not say which base model it belongs to; pass the base explicitly (--base)")
    if base is None and looks_like_a_folder(base_model["name"]) and not Path(base_model["name"]).is_dir():
        raise FileNotFoundError(f"{source} was trained on the base model folder {base_model['name']!r}, which is not "
                                "there (moved, or another machine): pass where it is now (--base, or base= in Python)")
    model, processor = load_backbone(base_model["name"], **_load_kwargs(base_model, source, trust_remote_code))
    return model, processor, base_model


def load_base_model(loaded: Loaded, base: str | None = None) -> nn.Module:
    """A fresh copy of the unmodified base model `loaded` was trained on (`base` overrides the recorded name).
    Loading `loaded` already allowed any remote code its base records."""
    return _load_base(loaded.base_model, base, "the loaded model", trust_remote_code=True)[0].eval()


def load_checkpoint(path: str | os.PathLike, base: str | None = None, *, trust_remote_code: bool = False,
                    torch_dtype: str | None = None) -> Loaded:
    """Rebuild the trained model of a Lightning checkpoint written by `RetrofitModule` (no Lightning needed).
    A base recorded with `trust_remote_code` is refused unless `trust_remote_code` (the same in every loader);
    `torch_dtype` loads the weights in that dtype instead of the recorded one (as in every loader)."""
    path = Path(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, KeyError, ValueError) as error:  # a cut or foreign file
        raise AdapterMismatchError(f"{path} is not a readable checkpoint ({type(error).__name__}: {error}): a file cut "
                                   "short or not written by torch.save; use another of the run's step*.ckpt") from error
    if not isinstance(checkpoint, dict):
        raise AdapterMismatchError(f"{path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    meta = checkpoint.get(CHECKPOINT_SECTION)
    if meta is None:
        raise AdapterMismatchError(f"{path} was not written by vlm_retrofit's RetrofitModule (no '{CHECKPOINT_SECTION}' section)")
    hp = checkpoint.get("hyper_parameters", {})
    saved_base = {"name": meta.get("backbone") or hp.get("backbone"), "kwargs": hp.get("backbone_kwargs") or {},
                  "torch_dtype": hp.get("torch_dtype"), "attn_implementation": hp.get("attn_implementation"),
                  "model_class": hp.get("model_class"), "trust_remote_code": hp.get("trust_remote_code", False)}
    model, processor, base_model = _load_base(saved_base, base, str(path), trust_remote_code, torch_dtype)
    check_fingerprint(meta["base_fingerprint"], base_fingerprint(model), projections=True,
                      source=f"checkpoint {path} (trained on {meta.get('backbone')!r}, given {base_model['name']!r})")
    lora = meta.get("lora")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora))
    adapter = attach_routers(model, RouterConfig.from_dict(meta["router_config"]))
    check_layout(meta.get("layout"), adapter.layout, source=f"checkpoint {path}")
    state = checkpoint["state_dict"]
    router_state = {k.removeprefix("adapter."): v for k, v in state.items() if k.startswith("adapter.")}
    trained_routers = any(k.startswith("adapter.") for k in meta.get("trainable_keys", state))
    if trained_routers:  # with `train_routers: false` the routers stayed at identity and were not saved
        adapter.load_state_dict(router_state)
    lora_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    if lora_state:
        result = model.load_state_dict(lora_state, strict=False)
        if result.unexpected_keys:
            raise AdapterMismatchError(f"{path}: LoRA tensors {result.unexpected_keys[:5]} do not fit the model")
    adapter.base_model = base_model
    # What training recorded for skipping: the removal order static calibration and pruning take a prefix of,
    # the removals it was trained for, and the per-token settings calibration defaults to.
    adapter.restore_training_record(meta)
    replacement = None
    if meta.get("replacements") is not None:
        replacement = ({int(k): v for k, v in meta["replacements"].items()}, list(meta["replacement_layers"]))
    return Loaded(model.eval(), processor, adapter, base_model, dict(lora) if lora else None, "checkpoint", replacement)


def load_adapter_folder(path: str | os.PathLike, base: str | None = None, *, trust_remote_code: bool = False,
                        torch_dtype: str | None = None) -> Loaded:
    """Load base + routers (+ `lora/` if present) from an adapter folder written by `save_pretrained`."""
    path = Path(path)
    saved = read_adapter_config(path)
    # Folders written before companions were recorded: a `lora/` that is there must be whole.
    required = list(saved.get("companions") or (LORA_FILES if (path / "lora").is_dir() else []))
    check_complete(path, [CONFIG_NAME, WEIGHTS_NAME, *required], "adapter")
    model, processor, base_model = _load_base(saved.get("base_model") or {}, base, str(path), trust_remote_code,
                                              torch_dtype)
    check_fingerprint(saved["base_fingerprint"], base_fingerprint(model), projections=True, source=f"adapter {path}")
    lora = None
    if (path / "lora" / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path / "lora")
        lora = json.loads((path / "lora" / "adapter_config.json").read_text())
    adapter = RouterAdapter.from_pretrained(model, path)
    adapter.base_model = base_model
    return Loaded(model.eval(), processor, adapter, base_model, lora, "adapter", load_replacements(path))


def read_release_config(directory: Path) -> dict[str, Any]:
    """The release config of `directory`, after checking that every file it makes the release need is there."""
    path = directory / RELEASE_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise FileNotFoundError(f"{path} is missing or unreadable ({type(error).__name__}: {error}): not a release "
                                "folder, or one copied in part") from error
    if not isinstance(config, dict) or config.get("format") != RELEASE_FORMAT:
        raise AdapterMismatchError(f"{path} is not a vlm_retrofit release")
    if int(config.get("format_version", 1)) > RELEASE_FORMAT_VERSION:
        raise AdapterMismatchError(f"{path} is release format {config['format_version']}, newer than this vlm_retrofit "
                                   f"reads ({RELEASE_FORMAT_VERSION}): upgrade vlm_retrofit")
    required = ["processor"]
    if config.get("full_weights"):
        required.append("model/config.json")
    if not config.get("pruned"):
        required += [f"router/{CONFIG_NAME}", f"router/{WEIGHTS_NAME}"]
    if config.get("lora") == "adapter":
        required += LORA_FILES
    elif config.get("lora") == "merged" and not config.get("full_weights"):
        required.append(MERGED_LORA)
    # Without them the release loads as another model: the base without its LoRA, or without its routers.
    check_complete(directory, required, "release")
    return config


def _load_release(directory: Path, trust_remote_code: bool = False, torch_dtype: str | None = None,
                  base: str | None = None) -> Loaded:
    config = read_release_config(directory)
    if base is not None and config.get("full_weights"):
        raise AdapterMismatchError(f"release {directory} carries its own full weights (model/): a base to load "
                                   f"({base!r}) applies only to a release without them. Drop --base / base=")
    base_model = config["base_model"]
    if torch_dtype is not None:
        base_model = {**base_model, "torch_dtype": torch_dtype}
    if config.get("full_weights"):
        model, processor = load_backbone(str(directory / "model"), processor_from=str(directory / "processor"),
                                         **_load_kwargs({**base_model, "kwargs": None}, str(directory), trust_remote_code))
        if config.get("pruned"):  # a plain, shallower model of the base's class: no routers, nothing merged on top
            return Loaded(model.eval(), processor, None, base_model, config.get("lora"), "release")
    else:
        model, _, base_model = _load_base(base_model, base, str(directory), trust_remote_code)
        check_fingerprint(config["base_fingerprint"], base_fingerprint(model), projections=True,
                          source=f"release {directory}")  # the plain base, before what the release merges into it
        processor = load_processor(str(directory / "processor"),
                                   trust_remote_code=bool(base_model.get("trust_remote_code")))
    if (directory / MERGED_LORA).is_file():
        merged = load_file(str(directory / MERGED_LORA))
        own = model.state_dict()
        unknown = sorted(k for k in merged if k not in own or own[k].shape != merged[k].shape)
        if unknown:
            raise AdapterMismatchError(f"{directory / MERGED_LORA} holds tensors the base does not have: {unknown[:5]}")
        untie(model, merged)  # a trained head stays apart from the base's embeddings it was tied to
        model.load_state_dict(merged, strict=False)
    if (directory / "lora").is_dir():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, directory / "lora")
    adapter = RouterAdapter.from_pretrained(model, directory / "router")
    adapter.base_model = base_model
    return Loaded(model.eval(), processor, adapter, base_model, config.get("lora"), "release")


def load_release(directory: str | os.PathLike, *, trust_remote_code: bool = False, torch_dtype: str | None = None,
                 base: str | None = None) -> tuple[nn.Module, Any]:
    """`(model, processor)` of a release folder; `vlm_retrofit.get_adapter(model)` gives its routers, e.g.
    `with get_adapter(model).skipping("recent_weight", target_saving=0.3): model.generate(...)`. A pruned
    release is a plain model with fewer layers (no routers; `transformers` alone can load its `model/`).
    `torch_dtype` loads the weights in that dtype instead of the one the release records; `base` loads the base
    from there instead of where the release records it (a release without full weights reads the base's own;
    the base is checked against the one it was trained on).

    The routers live beside the model, not in it: `model.save_pretrained` writes the weights without them (and a
    LoRA kept as an adapter as a PEFT folder), so ship the release folder itself. Move the loaded model with
    `.to(device)`; the routers follow it."""
    loaded = _load_release(Path(directory), trust_remote_code, torch_dtype, base)
    return loaded.model, loaded.processor


def release_config_of(path: str | os.PathLike) -> dict[str, Any] | None:
    """The release config of `path` where it is a release folder (checked complete), else None: what a command
    can refuse by before loading any weights."""
    path = Path(path)
    return read_release_config(path) if (path / RELEASE_CONFIG).is_file() else None


def is_pruned_release(path: str | os.PathLike) -> bool:
    """Whether `path` is a pruned release folder (its layers deleted, no routers left): read from its config only."""
    return bool((release_config_of(path) or {}).get("pruned"))


def summarize_pruning(directory: str | os.PathLike) -> str:
    """One line on what a pruned release removed (read from its release config)."""
    pruned = read_release_config(Path(directory))["pruned"]
    return (f"decoder layers {pruned['removed_layers']} of {pruned['num_layers_before']} deleted at merge: "
            f"{100 * pruned['layer_compute_removed']:.1f} % of decoder-layer compute saved on every token")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to an option's help unless its help already says its default or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


def add_dtype_flag(parser: Any) -> None:
    """`--dtype` for the commands that load what training or merging wrote."""
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="load the weights in this dtype instead of the one recorded (e.g. float32 for a bf16 "
                             "release on a CPU without fast bf16 kernels: python -m vlm_retrofit.hardware)")


def add_device_flag(parser: Any) -> None:
    """`--device` for the commands that run what training or merging wrote."""
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu, cuda or cuda:N (the routers and the inputs follow it)")


def warn_about_slow_dtype(command: str, model: nn.Module, device: str = "cpu") -> None:
    """One line on stderr where `model` holds bf16 weights that `device` has no fast kernels for."""
    from .hardware import fast_bf16  # here: `python -m vlm_retrofit.hardware` would find it imported already

    if floating_dtype(model) == torch.bfloat16 and not fast_bf16(device):
        print(f"{command}: note: these weights are bfloat16, which this {device.upper()} has no fast kernels for (some "
              "70x slower than fp32 on an AVX2-only CPU): --dtype float32 loads them in fp32", file=sys.stderr)


def add_trust_remote_code_flag(parser: Any) -> None:
    """`--trust-remote-code` for the commands that load what training or merging wrote."""
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a base model recorded with trust_remote_code to run its own Python code "
                             "(refused by default)")


def load_trained(path: str | os.PathLike, base: str | None = None, *, trust_remote_code: bool = False,
                 torch_dtype: str | None = None) -> Loaded:
    """Whatever training or merging produced: a checkpoint file, an adapter folder or a release folder; the weights
    in `torch_dtype` where given, else in the dtype recorded."""
    path = Path(path)
    if path.is_file():
        return load_checkpoint(path, base, trust_remote_code=trust_remote_code, torch_dtype=torch_dtype)
    if (path / RELEASE_CONFIG).is_file():
        return _load_release(path, trust_remote_code, torch_dtype, base=base)
    if (path / CONFIG_NAME).is_file():
        return load_adapter_folder(path, base, trust_remote_code=trust_remote_code, torch_dtype=torch_dtype)
    raise FileNotFoundError(f"{path} is neither a checkpoint file, a router adapter folder ({CONFIG_NAME}) "
                            f"nor a release folder ({RELEASE_CONFIG})")


# -- merging --------------------------------------------------------------------------------------------
def _lora_base_weight_keys(peft_model: nn.Module) -> list[str]:
    """State-dict keys (after merge_and_unload) of the weights a LoRA changes: those of its adapted layers and of
    the modules PEFT trains beside it (`modules_to_save` copies of norms or heads, which the merge puts in place of
    the originals, and `trainable_token_indices` rows, which it writes into the embeddings)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    prefix = "base_model.model."
    keys = []
    for name, module in peft_model.named_modules():
        base = name.removeprefix(prefix)
        parameter = getattr(module, "parameter_name", None)
        if isinstance(module, LoraLayer) and parameter is not None:
            # `target_parameters`: a parameter of the module (a mixture's stacked experts); PEFT nests one wrapper per
            # parameter of the same module, each under the next one's `base_layer`.
            while base.endswith(".base_layer"):
                base = base.removesuffix(".base_layer")
            keys.append(f"{base}.{parameter}")
        elif isinstance(module, LoraLayer):
            keys.append(f"{base}.weight")
            if getattr(module.get_base_layer(), "bias", None) is not None:
                keys.append(f"{base}.bias")
        elif isinstance(module, AuxiliaryTrainingWrapper):
            keys.extend(f"{base}.{key}" for key in module.original_module.state_dict())
    return sorted(keys)


def _sample_inputs(processor: Any) -> dict[str, Any]:
    from .testing import tiny_inputs

    return tiny_inputs(processor, batch=2, with_image=True)


@torch.no_grad()
def real_logits(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """Logits at the real (non-padding) positions: padding rows differ between attention kernels."""
    logits = model(**inputs).logits.float()
    mask = inputs.get("attention_mask")
    return logits[mask.bool()] if mask is not None else logits


def _model_card(loaded: Loaded, config: dict[str, Any]) -> str:
    adapter = loaded.adapter
    lora = {"adapter": "a PEFT LoRA, applied on load, in `lora/`",
            "merged": "merged into the weights in `model/`" if config["full_weights"] else
                      f"merged: the weights it changed, in `{MERGED_LORA}`, replace the base's on load"}
    lines = [
        f"# {config['base_model']['name']} + vlm_retrofit depth routers",
        "",
        "Depth routers (Attention Residuals) retrofitted into the frozen language backbone and trained by",
        "self-distillation; the routing signal skips decoder blocks per token at generation time (ReSkip).",
        "",
        "## Contents",
        "",
        f"* backbone: `{config['base_model']['name']}` (`{adapter.fingerprint['model_type']}`, "
        f"{adapter.fingerprint['num_layers']} layers, hidden {adapter.fingerprint['hidden_size']})",
        "* weights: " + ("complete, in `model/`. `transformers` alone loads them as the model *without* its routers "
                         "(other outputs): load the release with `load_release` to route and skip" if config["full_weights"]
                         else "not included: the base loads from its own source, checked against the one trained on"),
        f"* LoRA: {lora.get(config['lora'], 'none')}",
        f"* router adapter: `router/` ({sum(p.numel() for p in adapter.parameters()):,} parameters; blocks "
        f"{list(adapter.layout.block_starts)}; skippable {list(adapter.layout.skippable_blocks)})",
        f"* router config: `{json.dumps(adapter.config.to_dict(), sort_keys=True)}`",
        "* `processor/`: the processor and chat template; `release_config.json`: the base, its fingerprint and "
        "what this folder holds (`load_release` reads it)",
        "",
        "## Measured at calibration",
        "",
    ]
    if adapter.calibration_metrics:
        lines += ["The saving reached on the calibration batches (teacher-forced, where the thresholds were set; in the",
                  "target's unit: layer executions skipped, or decoder-layer FLOPs saved) and decoder-block compute saved",
                  "while generating from their prompts (prefill included, where a block runs unless every token skips",
                  "it): the second is what decoding saves.", "",
                  "| policy | target saving | reached on the calibration batches | compute saved generating | "
                  "token match vs unskipped |",
                  "|---|---|---|---|---|"]
        for policy, targets in sorted(adapter.calibration_metrics.items()):
            for target, metrics in sorted(targets.items()):
                shared = ", one threshold shared by its blocks" if metrics.get("allocation") == "shared" else ""
                lines.append(f"| {policy} | {float(target):.2f} {metrics.get('unit', 'layers')}{shared} | "
                             f"{metrics.get('achieved_saving', float('nan')):.3f} | "
                             f"{metrics.get('generation_compute_saved', float('nan')):.3f} | "
                             f"{metrics.get('token_match', float('nan')):.3f} |")
    else:
        lines.append("Not calibrated: pass explicit thresholds, or run `python -m vlm_retrofit calibrate` first.")
    calibrated = sorted(p for p, targets in adapter.calibration.items() if targets)  # settings, measured or not
    policy, target = ((calibrated[0], f"{float(min(adapter.calibration[calibrated[0]])):g}") if calibrated
                      else ("recent_weight", "..."))
    lines += [
        "",
        "## Loading",
        "",
        "```python",
        "from vlm_retrofit import get_adapter, load_release",
        "model, processor = load_release(\"<this folder>\")",
        f"with get_adapter(model).skipping(\"{policy}\", target_saving={target}) as report:"
        + ("" if calibrated else "  # after calibrating for it"),
        "    output = model.generate(**inputs, max_new_tokens=64)",
        "print(report.summary())",
        "```",
        "",
        "or `python -m vlm_retrofit generate --model <this folder> --image IMAGE --prompt TEXT`.",
        "",
    ]
    return "\n".join(lines)


def refresh_model_card(directory: Path, loaded: Loaded) -> None:
    """Rewrite a release's model card from `loaded` (e.g. after calibrating its routers in place)."""
    card = _model_card(loaded, read_release_config(directory))
    atomic_write(directory / "README.md", lambda path: Path(path).write_text(card))


def save_full_weights(model: nn.Module, folder: Path) -> None:
    """`model`'s complete weights and config in `folder` (safetensors), loadable by `transformers` alone."""
    plain = unwrap_model(model)
    record_untied_embeddings(plain)  # a merged head of its own must not load tied to the embeddings again
    plain.save_pretrained(folder, safe_serialization=True)


def _write_release(loaded: Loaded, directory: Path, merge_lora: bool, full_weights: bool) -> nn.Module:
    """Write the release of `loaded` into `directory`; returns the model it wrote (the LoRA merged, if asked)."""
    directory.mkdir(parents=True)
    model = loaded.model
    lora_mode = None
    trained_on = loaded.adapter.fingerprint  # the plain base's, projections included: what a release loads onto
    if loaded.lora:
        if merge_lora or full_weights:
            changed = _lora_base_weight_keys(model)
            model = loaded.adapter.merge_lora()
            changed = with_tied_partners(model, changed)  # trained token rows of a tied head are in both
            lora_mode = "merged"
            # The release loads as these merged weights: a LoRA on the head or the embeddings changed samples there.
            loaded.adapter.fingerprint = unchanged_fingerprint(loaded.adapter.fingerprint, model)
            if not full_weights:
                state, tensors, written = model.state_dict(), {}, set()
                for key in changed:
                    tensor = state[key].detach().cpu().contiguous()
                    if tensor.data_ptr() in written:  # safetensors refuses two names of one tensor (tied weights)
                        tensor = tensor.clone()
                    written.add(tensor.data_ptr())
                    tensors[key] = tensor
                save_file(tensors, str(directory / MERGED_LORA), metadata={"format": "pt"})
        else:
            model.save_pretrained(directory / "lora")
            lora_mode = "adapter"
    if full_weights:
        save_full_weights(model, directory / "model")
    loaded.adapter.save_pretrained(directory / "router", companions=[])  # the release config names its files
    loaded.processor.save_pretrained(directory / "processor")
    base_model = dict(loaded.base_model)
    # The release must run the attention kernel the source ran (saved configs do not record it).
    base_model.setdefault("attn_implementation", None)
    base_model["attn_implementation"] = base_model["attn_implementation"] or unwrap_model(model).config._attn_implementation
    config = {
        "format": RELEASE_FORMAT,
        "format_version": RELEASE_FORMAT_VERSION,
        "base_model": base_model,
        "base_fingerprint": trained_on,
        "full_weights": bool(full_weights),
        "lora": lora_mode,
    }
    (directory / RELEASE_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "README.md").write_text(_model_card(loaded, config))
    return model


def merge(source: str | os.PathLike, output: str | os.PathLike, *, base: str | None = None, merge_lora: bool = False,
          full_weights: bool = False, verify: bool = True, prune_blocks: list[int] | None = None,
          prune_target: float | None = None, allow_untrained_removal: bool = False,
          trust_remote_code: bool = False) -> Path:
    """Write a release folder for a checkpoint or adapter folder; see `python -m vlm_retrofit merge --help`.

    Atomic: everything is written to a hidden temporary folder beside `output` and renamed into place at
    the end; on any error nothing is left behind. With `verify`, the written release is loaded back and
    must reproduce the source model's logits (fp32 tolerance 1e-4) before it is moved into place. A LoRA merged
    into bfloat16 / float16 weights rounds them: such a release must reproduce the merged weights, and what the
    merge changed (`lora_merge_logit_change`, max over the sample logits, and `lora_merge_top1_agreement`, the share
    of sample positions whose greedy token it kept) is recorded in its release_config.json.
    `prune_blocks` / `prune_target` write a pruned release instead (see `vlm_retrofit.pruning`): the blocks the
    static policy removes are deleted from the weights (LoRA merged, routers dropped), and verification
    compares with plain removal of those blocks from the unpruned model (in fp32 for a half-precision model). A
    removal the adapter was not trained for is refused before any work unless `allow_untrained_removal`
    (`pruning.blocks_to_prune`).
    """
    output = Path(output)
    if output.resolve() == Path(source).resolve() or output.resolve() in Path(source).resolve().parents:
        raise InputError(f"--output {output} holds the input {source}: the release replaces the folder whole, so "
                         "give it a folder of its own")
    check_replaceable(output, "release")  # and staged_folder checks again when it writes
    release = release_config_of(source) or {}  # refused before anything loads
    if release.get("pruned"):
        raise InputError(f"{source} is a pruned release: it has no routers left to merge; merge the adapter or "
                         "checkpoint it came from")
    if release.get("lora") == "merged":
        raise InputError(f"{source} is a release whose LoRA is merged into its weights, which a new release of it "
                         "would not carry; merge the adapter or checkpoint it came from")
    loaded = load_trained(source, base, trust_remote_code=trust_remote_code)
    pruning = prune_blocks is not None or prune_target is not None
    if loaded.replacement is not None and not pruning:
        raise InputError(f"{source} carries a replacement of removed layers {loaded.replacement[1]}, which only a "
                         "pruned release can use: pass --prune-target (or --prune-blocks) for those layers")
    inputs = None
    if verify or pruning:  # the checks run chat prompts (and a release without a template could not answer one)
        require_chat_template(loaded.processor, loaded.base_model.get("name", str(source)),
                              "renders the prompts the merge is checked on")
        inputs = _sample_inputs(loaded.processor)
    if pruning:
        from .pruning import blocks_to_prune, prune_for_release, write_pruned_release

        blocks = blocks_to_prune(loaded.adapter, blocks=prune_blocks, target_saving=prune_target,
                                 allow_untrained=allow_untrained_removal)
        model, expected, pruned = prune_for_release(loaded, blocks, inputs)
    else:
        expected = real_logits(loaded.model, inputs) if verify else None
    with staged_folder(output, "merging", "release") as staging:
        if pruning:
            write_pruned_release(loaded, model, staging, pruned)
        else:
            written = _write_release(loaded, staging, merge_lora, full_weights)
            if verify and loaded.lora and (merge_lora or full_weights) and half_precision(written):
                merged = real_logits(written, inputs)  # the routers are still attached
                config = json.loads((staging / RELEASE_CONFIG).read_text())
                config["lora_merge_logit_change"] = (merged - expected).abs().max().item()
                # The max is one logit of one position; the share of positions whose greedy token stayed says
                # whether the rounding changes what the model writes.
                config["lora_merge_top1_agreement"] = (merged.argmax(-1) == expected.argmax(-1)).float().mean().item()
                (staging / RELEASE_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                expected = merged
        if verify:
            if not pruning:
                loaded.adapter.detach()  # the source's hooks would otherwise stay on a model we no longer use
            # A pruned half-precision model is checked in fp32, where its reference was computed (see
            # `prune_for_release`): the same weights, so the tolerance stays fp32's.
            in_fp32 = pruning and half_precision(model)
            released, _ = load_release(staging, trust_remote_code=trust_remote_code,
                                       torch_dtype="float32" if in_fp32 else None)
            diff = (real_logits(released, inputs) - expected).abs().max().item()
            if not diff <= VERIFY_ATOL:
                raise ReleaseVerificationError(f"the release does not reproduce {source}"
                                               + (" with those blocks removed" if pruning else "")
                                               + f": logits differ by {diff:.3g}")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_retrofit merge",
                                     formatter_class=HelpFormatter,
                                     description="Write a release folder: router adapter, skip calibration, "
                                                 "processor, model card (and optionally full weights).")
    parser.add_argument("--ckpt", "--model", dest="ckpt", required=True,
                        help="Lightning checkpoint (.ckpt), router adapter folder, or a release whose LoRA is not "
                             "merged (--model, as calibrate and generate name it, is the same option)")
    parser.add_argument("--output", required=True, help="release folder to write (replaced atomically)")
    parser.add_argument("--base", default=None, help="base model (hub id, folder or tiny:<family>); "
                                                     "default: the one the checkpoint names. A different base is refused")
    parser.add_argument("--merge-lora", action="store_true", help="fold a LoRA into the weights it changes")
    parser.add_argument("--full-weights", action="store_true", help="include the complete weights (LoRA merged)")
    parser.add_argument("--no-verify", action="store_true", help="skip the logits check of the written release")
    prune = parser.add_mutually_exclusive_group()
    prune.add_argument("--prune-target", type=float, default=None,
                       help="write a pruned release: delete the blocks the static policy removes at this target saving "
                            "(stored static calibration, else the trained removal order) from the weights, merge the "
                            "LoRA and drop the routers; a plain, shallower model with no runtime overhead (implies "
                            "--full-weights and --merge-lora). The target is a fraction of the decoder layers: with "
                            "sliding-window layers the FLOPs it saves depend on the context length")
    prune.add_argument("--prune-blocks", type=lambda text: [int(b) for b in text.split(",")], default=None,
                       help="write a pruned release deleting these router blocks (comma-separated, e.g. 13,16,17)")
    parser.add_argument("--allow-untrained-removal", action="store_true",
                        help="prune blocks the adapter was not trained to run without (another count or other blocks "
                             "than its removal schedule's), which is refused by default")
    add_trust_remote_code_flag(parser)
    ns = parser.parse_args(argv)
    if ns.prune_target is not None and not 0 < ns.prune_target < 1:
        print(f"merge refused: --prune-target is a fraction of the decoder layers between 0 and 1, got "
              f"{ns.prune_target}", file=sys.stderr)
        return 1
    try:
        path = merge(ns.ckpt, ns.output, base=ns.base, merge_lora=ns.merge_lora, full_weights=ns.full_weights,
                     verify=not ns.no_verify, prune_blocks=ns.prune_blocks, prune_target=ns.prune_target,
                     allow_untrained_removal=ns.allow_untrained_removal, trust_remote_code=ns.trust_remote_code)
    except (AdapterMismatchError, FileNotFoundError, FileExistsError, ValueError, ReleaseVerificationError) as error:
        print(f"merge refused: {error}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"release written to {path} ({size / 1024:.1f} KiB); verified: {not ns.no_verify}")
    config = json.loads((path / RELEASE_CONFIG).read_text())
    if "lora_merge_logit_change" in config:
        print(f"merging the LoRA into half-precision weights changed the sample logits by up to "
              f"{config['lora_merge_logit_change']:.3g} and kept the greedy token at "
              f"{100 * config['lora_merge_top1_agreement']:.1f} % of the sample positions "
              "(the release reproduces the merged weights)")
    print(f"load it with vlm_retrofit.load_release({str(path)!r}) or python -m vlm_retrofit generate --model {path}")
    return 0
