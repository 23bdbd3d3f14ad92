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
        # mkstemp makes it private (0600), and some writers (safetensors) create their own so: a written file is
        # as readable as any other the process creates.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def check_complete(folder: Path, required: list[str], what: str) -> None:
    """Refuse a `folder` missing any of its `required` files, or holding a safetensors file cut short or damaged,
    before anything loads: the loaders' own errors name neither (e.g. "Repo id must be in the form ...")."""
    from safetensors import SafetensorError, safe_open

    missing = [name for name in required if not (folder / name).exists()]
    if missing:
        raise FileNotFoundError(f"{what} {folder} is incomplete: {', '.join(missing)} missing. Copy the whole folder "
                                "again")
    for path in sorted(folder.rglob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise FileNotFoundError(f"{what} {folder}: {path.relative_to(folder)} is damaged ({error}): cut short by "
                                    "a copy or download, or not a safetensors file. Copy it again") from error


def check_replaceable(output: Path, kind: str) -> None:
    """Refuse an `output` that replacing whole would lose files this package did not write, or a folder of another
    kind than the one written (`kind`: "adapter" or "release"; a release written over a trained adapter would lose
    its training): anything but a missing or empty folder, or an earlier folder of that kind."""
    from .backbones.loading import RELEASE_CONFIG
    from .routing.adapter import CONFIG_NAME

    if not output.exists():
        return
    if not output.is_dir():
        raise FileExistsError(f"{output} is a file; give a folder to write into (it is replaced whole)")
    markers = {"adapter": CONFIG_NAME, "release": RELEASE_CONFIG}
    if (output / markers[kind]).is_file():
        return
    other = next((name for name, marker in markers.items() if (output / marker).is_file()), None)
    if other is not None:
        raise FileExistsError(f"{output} is {'an' if other == 'adapter' else 'a'} {other} folder: writing this {kind} "
                              f"would replace it whole and lose it. Give another folder")
    held = sorted(p.name for p in output.iterdir())
    if held:
        raise FileExistsError(f"{output} holds {held[:5]}{' ...' if len(held) > 5 else ''}, which is not an earlier "
                              f"{kind} folder: writing it would replace the folder whole and delete them. Give a new "
                              f"folder (or an earlier {kind} folder), or empty it yourself")


def _umask() -> int:
    """The process's umask, read without changing it where the OS shows it (setting it, even briefly, would apply
    to files other threads create meanwhile)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_folder(output: Path, purpose: str, kind: str) -> Iterator[Path]:
    """A hidden folder beside `output` to write into. When the block succeeds it replaces `output` whole (no
    file of an earlier folder survives in it); when it fails it is removed and `output` is left as it was. An
    `output` holding anything else than an earlier folder of this `kind` is refused first (`check_replaceable`)."""
    check_replaceable(output, kind)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.{purpose}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
        # Writers that stage files privately (safetensors writes 0600) would leave a shipped release unreadable by
        # other users or a serving container: every file gets the modes the umask gives any new file.
        mask = _umask()
        for path in staging.rglob("*"):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
        previous = output.parent / f".{output.name}.previous"
        shutil.rmtree(previous, ignore_errors=True)
        if output.exists():
            os.rename(output, previous)
        os.rename(staging, output)
        shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


LORA_FILES = ["lora/adapter_config.json", "lora/adapter_model.safetensors"]
"""What PEFT's `save_pretrained` writes for a LoRA under `lora/` that loading it needs."""


def write_adapter_folder(directory: Path, adapter: Any, lora_model: Any | None = None,
                         replacement: tuple[Mapping[int, Any], list[int]] | None = None) -> Path:
    """A complete adapter folder, replaced whole: the routers (`adapter_config.json` + `adapter_model.safetensors`),
    the LoRA of `lora_model` (a PEFT model) under `lora/`, and a linear replacement (transforms, removed layers) as
    `replacement.safetensors`. No file an earlier folder held survives to be merged with these routers."""
    from .replacement import REPLACEMENT_FILE, save_replacements

    companions = [*(LORA_FILES if lora_model is not None else []), *([REPLACEMENT_FILE] if replacement else [])]
    with staged_folder(directory, "saving", "adapter") as staging:
        adapter.save_pretrained(staging, companions=companions)
        if lora_model is not None:
            lora_model.save_pretrained(staging / "lora")
        if replacement is not None:
            save_replacements(staging, *replacement)
    return directory
