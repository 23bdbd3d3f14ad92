"""Loading the frozen backbone and its processor: a HF hub id / local folder, or `tiny:<family>` (offline tests)."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import InputError
from .registry import load_plugins, spec_for

HUB_ID = r"[\w.-]+(/[\w.-]+)?"
"""What a model hub id looks like (`name` or `org/name`); a backbone name of another form is a local path."""
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | None) -> torch.dtype | str | None:
    """`None` (library default), `"auto"` (the checkpoint's dtype) or a name in `DTYPES`."""
    if name is None or name == "auto":
        return name
    if name not in DTYPES:
        raise InputError(f"torch_dtype must be one of {sorted(DTYPES)}, 'auto' or null, got {name!r}")
    return DTYPES[name]


def looks_like_a_folder(name: str) -> bool:
    """Whether a backbone `name` can only be a local folder: absolute, `./` or `../` relative, or with more than one
    `/` (a hub id has at most one)."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or name in (".", "..")


def recorded_name(name: str) -> str:
    """`name` as an adapter records its base: an existing local folder as an absolute path, so that what was trained
    on it loads from any working directory; a hub id or `tiny:` name as given."""
    if name.startswith("tiny:") or not Path(name).expanduser().is_dir():
        return name
    return str(Path(name).expanduser().resolve())


RELEASE_CONFIG = "release_config.json"  # marks a folder written by `vlm_retrofit merge`


def release_folders(name: str) -> tuple[str, str] | None:
    """(model folder, processor folder) when `name` is a pruned release (`merge --prune-target`): a plain,
    shallower model with no routers, which can be the backbone of a new retrofit. None when `name` is not a
    release folder.

    Any other release computes with its trained routers, so no plain model in it is what it computes: refused.
    """
    config_path = Path(name) / RELEASE_CONFIG
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    if not (config.get("pruned") and config.get("full_weights")):
        base = config.get("base_model", {}).get("name")
        raise InputError(
            f"{name} is a vlm_retrofit release of trained routers on top of {base!r}: without them no model in it "
            "computes what the release does. Use its base as the backbone, or write a pruned release (merge "
            "--prune-target) and use that folder")
    return str(Path(name) / "model"), str(Path(name) / "processor")


def _import(path: str) -> Any:
    import transformers

    if "." not in path:
        return getattr(transformers, path)
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _weights_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast `model` to `dtype` as `from_pretrained(dtype=...)` loads it: the buffers it does not save (rotary
    frequencies, computed at init) stay fp32, so a tiny model in bf16 runs as a saved and reloaded one does."""
    kept = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()
            if buffer is not None and buffer.is_floating_point() and name in module._non_persistent_buffers_set]
    model.to(dtype)
    for module, name, buffer in kept:
        module._buffers[name] = buffer


def floating_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of `model`'s first floating parameter (None without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def half_precision(model: nn.Module) -> bool:
    """Whether `model`'s weights are bfloat16 or float16 (`floating_dtype`)."""
    return floating_dtype(model) in (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def weights_in_fp32(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with every floating parameter and buffer in fp32 within the context, each back in its own dtype
    after (exact: fp32 holds every bf16 and fp16 value). Parameters stay the same objects."""
    params: dict[int, tuple[nn.Parameter, torch.dtype]] = {}
    buffers: list[tuple[dict, str, torch.dtype]] = []
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != torch.float32:
                params.setdefault(id(param), (param, param.dtype))
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                buffers.append((module._buffers, name, buffer.dtype))
    for param, _ in params.values():
        param.data = param.data.float()
    for store, name, _ in buffers:
        store[name] = store[name].float()
    try:
        yield model
    finally:
        for param, dtype in params.values():
            param.data = param.data.to(dtype)
        for store, name, dtype in buffers:
            store[name] = store[name].to(dtype)


def load_backbone(name: str, *, trust_remote_code: bool = False, torch_dtype: str | None = None,
                  attn_implementation: str | None = None, model_class: str | None = None,
                  kwargs: dict[str, Any] | None = None, processor_from: str | None = None) -> tuple[nn.Module, Any]:
    """Return `(model, processor)` for `name`, the model in eval mode.

    * `tiny:<family>`: `vlm_retrofit.testing.tiny_vlm(family, **kwargs)` (kwargs = text-config overrides,
      e.g. `num_hidden_layers`), built offline with deterministic weights.
    * anything else: a hub id or local folder. The class is `model_class` if given (a `transformers` class
      name or a dotted path), else `AutoModelForImageTextToText`, falling back to `AutoModelForCausalLM` for
      text-only LMs. Remote code runs only with `trust_remote_code=True`. The processor is `AutoProcessor`
      (or `AutoTokenizer` for text-only models), read from `processor_from` if given, else from `name`.
      `kwargs` go to `from_pretrained` (e.g. `revision`).
    * a pruned release folder (`merge --prune-target`): its `model/` with its `processor/` (`release_folders`),
      e.g. to train routers on a pruned, healed model.
    """
    kwargs = dict(kwargs or {})
    dtype = resolve_dtype(torch_dtype)
    if name.startswith("tiny:"):
        from ..testing import tiny_vlm

        model, processor = tiny_vlm(name.split(":", 1)[1], **kwargs)
        if isinstance(dtype, torch.dtype):
            _weights_to(model, dtype)
        return model.eval(), processor

    import transformers

    release = release_folders(name)
    if release is not None:
        name, processor_from = release[0], processor_from or release[1]
    elif not Path(name).is_dir() and (name.startswith((".", "/", "~")) or not re.fullmatch(HUB_ID, name)):
        raise InputError(f"backbone {name!r}: no such folder. Give a hub id (org/name) or a folder that holds a saved "
                         "model (build it first where a config says how, e.g. `python -m bench.real_vlm`)")
    load_kw: dict[str, Any] = dict(trust_remote_code=trust_remote_code, **kwargs)
    if dtype is not None:
        load_kw["dtype"] = dtype
    if attn_implementation:
        load_kw["attn_implementation"] = attn_implementation
    config_kw = {k: v for k, v in kwargs.items() if k == "revision"}
    if model_class:
        model_class_ = _import(model_class)  # importing it may register its family
        config_class = getattr(model_class_, "config_class", None)
        if getattr(config_class, "model_type", ""):
            spec_for(config_class.model_type)
        model = model_class_.from_pretrained(name, **load_kw)
    else:
        load_plugins()  # a plug-in may register its family's transformers classes as well as its spec
        config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **config_kw)
        spec_for(config.model_type)  # an unsupported family is refused before its weights load (minutes for a 7B)
        try:
            model = transformers.AutoModelForImageTextToText.from_pretrained(name, config=config, **load_kw)
        except ValueError:
            model = transformers.AutoModelForCausalLM.from_pretrained(name, config=config, **load_kw)
    proc_kw = dict(trust_remote_code=trust_remote_code, **{k: v for k, v in kwargs.items() if k == "revision"})
    return model.eval(), load_processor(processor_from or name, **proc_kw)


def require_chat_template(processor: Any, source: str, purpose: str) -> None:
    """Refuse a processor (or the tokenizer of a text-only LM) that neither it nor its tokenizer gives a chat template,
    naming where it came from (`source`) and what needs one (`purpose`)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    if getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None):
        return
    raise InputError(
        f"the processor of {source} has no chat template, which {purpose}: put the template the model was "
        "tuned with beside its tokenizer (a chat_template.jinja file, e.g. from the instruct model it came from), "
        "or use a backbone that ships one; base models without any chat format are not supported")


def load_processor(source: str, **kwargs: Any) -> Any:
    """`AutoProcessor.from_pretrained(source)`, or `AutoTokenizer` for a text-only LM (which has no processor).

    `trust_remote_code` is False unless given in `kwargs`."""
    import transformers

    kwargs.setdefault("trust_remote_code", False)
    release = release_folders(source)
    if release is not None:
        source = release[1]
    try:
        return transformers.AutoProcessor.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, TypeError):
        return transformers.AutoTokenizer.from_pretrained(source, **kwargs)
