"""Atomic writes: a file or a whole folder (e.g. an adapter folder) is replaced in one rename, or left as it was."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """`write(tmp)` into a hidden file beside `path`, then rename it over `path`; on error nothing is left."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staged_folder(output: Path, purpose: str) -> Iterator[Path]:
    """A hidden folder beside `output` to write into. When the block succeeds it replaces `output` whole (no
    file of an earlier folder survives in it); when it fails it is removed and `output` is left as it was."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.{purpose}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
        previous = output.parent / f".{output.name}.previous"
        shutil.rmtree(previous, ignore_errors=True)
        if output.exists():
            os.rename(output, previous)
        os.rename(staging, output)
        shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_adapter_folder(directory: Path, adapter: Any, lora_model: Any | None = None,
                         replacement: tuple[Mapping[int, Any], list[int]] | None = None) -> Path:
    """A complete adapter folder, replaced whole: the routers (`adapter_config.json` + `adapter_model.safetensors`),
    the LoRA of `lora_model` (a PEFT model) under `lora/`, and a linear replacement (transforms, removed layers) as
    `replacement.safetensors`. No file an earlier folder held survives to be merged with these routers."""
    from .replacement import save_replacements

    with staged_folder(directory, "saving") as staging:
        adapter.save_pretrained(staging)
        if lora_model is not None:
            lora_model.save_pretrained(staging / "lora")
        if replacement is not None:
            save_replacements(staging, *replacement)
    return directory
