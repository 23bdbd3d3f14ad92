"""bench/bundle.py: parts round trip and refuse damage; pack -> unpack rebuilds a model tensor for tensor; real assets opt-in."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder at the repository root, not an installed package

from bench import bundle, real_vlm  # noqa: E402
from bench.data import STAMPS_SUBDIR, TUXPAINT_PKG  # noqa: E402


def test_parts_join_back_and_a_missing_or_damaged_part_is_named(tmp_path):
    payload = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    source = tmp_path / "whole.bin"
    source.write_bytes(payload.numpy().tobytes())
    out = tmp_path / "parts"
    out.mkdir()
    parts = bundle.split_file(source, out, 3_000)
    assert [p["bytes"] for p in parts] == [3_000, 3_000, 3_000, 1_000]
    (out / bundle.INDEX).write_text(json.dumps({"parts": parts, "created": "now"}))
    index = bundle.check_parts(out)
    assert bundle.joined(out, index).read() == source.read_bytes()

    (out / parts[2]["name"]).rename(tmp_path / "aside")
    with pytest.raises(FileNotFoundError, match=r"lacks 1 of its 4 parts: bundle\.tar\.002"):
        bundle.check_parts(out)
    damaged = bytearray((tmp_path / "aside").read_bytes())
    damaged[7] ^= 1
    (out / parts[2]["name"]).write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"bundle\.tar\.002 is damaged"):
        bundle.check_parts(out)
    with pytest.raises(FileNotFoundError, match="no bundle.json"):
        bundle.check_parts(tmp_path)


def test_tensor_digest_sees_dtype_shape_and_bytes():
    t = torch.arange(6, dtype=torch.float32)
    digests = {bundle.tensor_digest(x) for x in (t, t.view(2, 3), t.to(torch.float64), t + 1e-6 * (t == 5))}
    assert len(digests) == 4
    assert bundle.tensor_digest(t.view(2, 3).t()) == bundle.tensor_digest(t.view(2, 3).t().contiguous())


def test_weights_digest_names_one_build_and_refuses_a_folder_without_weights(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"projector A")
    (tmp_path / "model-00002.safetensors").write_bytes(b"language model")
    (tmp_path / "config.json").write_text("{}")
    first = real_vlm.weights_digest(tmp_path)
    assert len(first) == 16 and real_vlm.weights_digest(tmp_path) == first
    (tmp_path / "config.json").write_text('{"other": 1}')  # only the weights identify a build
    assert real_vlm.weights_digest(tmp_path) == first
    (tmp_path / "model-00001.safetensors").write_bytes(b"projector B")  # a rebuilt projector
    assert real_vlm.weights_digest(tmp_path) != first
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors in .*build the real VLM first"):
        real_vlm.weights_digest(tmp_path / "empty")


def _fake_data(data: Path) -> None:
    files = {
        "shards/captions-train/captions-train-000000.tar": b"tar",
        "shards/captions-train/_inputs/captions-train.jsonl": b"build input",
        "shards/austen-test.txt": b"It is a truth universally acknowledged.",
        "tuxpaint/pairs.json": b"{}",
        "tuxpaint/images/animals/frog.png": b"png",
        f"pkgs/{TUXPAINT_PKG}/.extracted.json": b"{}",
        f"pkgs/{TUXPAINT_PKG}/{STAMPS_SUBDIR}/frog.png": b"raw stamp",
        "pkgs/r-cran-janeaustenr/.extracted.json": b"{}",
        "pkgs/r-cran-janeaustenr/usr/lib/R/site-library/janeaustenr/data/Rdata.rdx": b"rdx",
        "debs/tuxpaint-stamps-default_1_all.deb": b"deb",
    }
    for rel, content in files.items():
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_bytes(content)
    manifest = {"root": str(data / "shards"), "shards": {"captions-train": {"dir": str(data / "shards/captions-train")}},
                "austen_test": {"path": str(data / "shards/austen-test.txt")}}
    (data / "shards" / "bench_data.json").write_text(json.dumps(manifest))


def test_data_files_are_what_the_bench_reads_once_built(tmp_path):
    _fake_data(tmp_path)
    kept = {p.as_posix() for p in bundle.data_files(tmp_path)}
    assert kept == {"shards/captions-train/captions-train-000000.tar", "shards/austen-test.txt",
                    "shards/bench_data.json", "tuxpaint/pairs.json", "tuxpaint/images/animals/frog.png",
                    f"pkgs/{TUXPAINT_PKG}/.extracted.json", "pkgs/r-cran-janeaustenr/.extracted.json",
                    "pkgs/r-cran-janeaustenr/usr/lib/R/site-library/janeaustenr/data/Rdata.rdx"}


WHEEL = "hello_bundle-0.1-py3-none-any.whl"


def _wheel(folder: Path) -> None:
    """A minimal pure-Python wheel (package `hello_bundle`, VALUE = 7)."""
    import zipfile

    folder.mkdir()
    files = {"hello_bundle/__init__.py": "VALUE = 7\n",
             "hello_bundle-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: hello-bundle\nVersion: 0.1\n",
             "hello_bundle-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                 "Tag: py3-none-any\n"}
    files["hello_bundle-0.1.dist-info/RECORD"] = "".join(f"{name},,\n" for name in [*files, "hello_bundle-0.1.dist-info/RECORD"])
    with zipfile.ZipFile(folder / WHEEL, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)


def _tiny_build(path: Path):
    """A tiny LLaVA saved as a real-VLM build, and the GGUF reader's view of its language model."""
    from vlm_retrofit.testing import tiny_vlm

    model, processor = tiny_vlm("llava")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    (path / "build_info.json").write_text(json.dumps({"recipe_version": real_vlm.RECIPE_VERSION}))
    lm_state = {f"model.{k}": v.clone() for k, v in model.model.language_model.state_dict().items()}
    return model, lm_state


def test_pack_then_unpack_rebuilds_the_model_exactly_and_relocates_the_data(tmp_path, monkeypatch):
    model, lm_state = _tiny_build(tmp_path / "built" / "real_vlm")
    data = tmp_path / "built" / "data"
    _fake_data(data)
    gguf = tmp_path / "lm.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    wheels = tmp_path / "wheels"
    _wheel(wheels)
    monkeypatch.setattr(real_vlm, "load_smollm2", lambda path: (lm_state, None, None))

    out = tmp_path / "bundle"
    index = bundle.pack(out, part_mb=0.05, real_vlm=tmp_path / "built" / "real_vlm", data=data, gguf=gguf, wheels=wheels)
    assert len(index["parts"]) > 1 and all(p["bytes"] <= 0.05 * 2 ** 20 for p in index["parts"])

    there = tmp_path / "elsewhere" / "cache"
    monkeypatch.setattr(sys, "path", list(sys.path))  # unpack puts the site folder first
    done = bundle.unpack(out, real_vlm=there / "real_vlm", data=there / "data", site=tmp_path / "site")
    assert set(done) == {"bundle", "real_vlm", "data", "wheels", "site"}
    assert __import__("hello_bundle").VALUE == 7  # the carried wheel, installed before the rebuild
    assert real_vlm.is_built(there / "real_vlm")
    from transformers import LlavaForConditionalGeneration

    rebuilt = LlavaForConditionalGeneration.from_pretrained(there / "real_vlm")
    expected = model.state_dict()
    assert rebuilt.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in rebuilt.state_dict().items())
    # The same build by its digest: adapters trained on the packing machine are reused here (`bench.run`'s key).
    assert real_vlm.weights_digest(there / "real_vlm") == real_vlm.weights_digest(tmp_path / "built" / "real_vlm")
    manifest = json.loads((there / "data" / "shards" / "bench_data.json").read_text())
    assert manifest["shards"]["captions-train"]["dir"] == str((there / "data" / "shards" / "captions-train").resolve())
    assert Path(manifest["austen_test"]["path"]).read_text() == "It is a truth universally acknowledged."
    assert (there / "data" / "pkgs" / TUXPAINT_PKG / STAMPS_SUBDIR).is_dir()
    assert not (there / "data" / "debs").exists() and (there / "wheels" / WHEEL).is_file()
    assert bundle.unpack(out, real_vlm=there / "real_vlm", data=there / "data").keys() == {"bundle", "wheels"}

    # A reader that de-quantises differently gives another model: refused, nothing written.
    lm_state["model.norm.weight"] = lm_state["model.norm.weight"] + 1e-3
    other = tmp_path / "other"
    with pytest.raises(ValueError, match="differs from the packed one"):
        bundle.unpack(out, real_vlm=other / "real_vlm", data=other / "data")
    assert not (other / "real_vlm").exists()


@pytest.mark.real
@pytest.mark.timeout(1800)
def test_real_assets_survive_the_bundle(tmp_path, monkeypatch):
    """The real VLM and shards, packed and unpacked elsewhere: every tensor checked, the shards found without any
    download."""
    from bench import data as bench_data

    if real_vlm.missing_packages():
        pytest.skip(f"bench packages missing: {', '.join(real_vlm.missing_packages())}")
    bench_data.write_bench_shards()
    real_vlm.build_real_vlm()
    index = bundle.pack(tmp_path / "bundle")
    assert all(p["bytes"] <= bundle.PART_MB * 2 ** 20 for p in index["parts"])
    assert index["bytes"] < 200 * 2 ** 20  # against 534 MB of weights + 239 MB of data cache

    def no_download(*args, **kwargs):
        raise AssertionError("the unpacked data should need no package download")

    monkeypatch.setattr(bench_data, "_download_deb", no_download)
    there = tmp_path / "cache"
    bundle.unpack(tmp_path / "bundle", real_vlm=there / "real_vlm", data=there / "data")
    manifest = bench_data.write_bench_shards(cache=there / "data")
    assert manifest["root"] == str((there / "data" / "shards").resolve())
    test = bench_data.tuxpaint_split("test", there / "data")
    assert test and all(path.is_file() for path, _ in test)
    model, _ = real_vlm.load_real_vlm(there / "real_vlm", build=False)
    reference, _ = real_vlm.load_real_vlm(build=False)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def _script_commands(script: Path, module: str, variables: dict[str, str] | None = None) -> list[list[str]]:
    """The arguments of every `"$PY" -m <module> ...` call in a shell script (continuation lines joined; `"$@"`
    dropped, a shell variable named in `variables` read as its value there and any other as the loop value 1; cut
    at `;`, a pipe or a redirection)."""
    import shlex

    text = script.read_text().replace("\\\n", " ")
    calls = []
    for line in text.splitlines():
        marker = f'"$PY" -m {module} '
        if marker in line:
            words = shlex.split(re.split(r";|\||\s2>&1", line.split(marker, 1)[1])[0])
            calls.append([(variables or {}).get(w[1:], "1") if w.startswith("$") else w for w in words if w != "$@"])
    return calls


def test_gpu_script_passes_only_arguments_its_commands_accept():
    from bench import overhead, run

    script = ROOT / "bench" / "gpu_bench.sh"
    runs = _script_commands(script, "bench.run")
    overheads = _script_commands(script, "bench.overhead")
    assert len(runs) == 1 and overheads, "gpu_bench.sh calls bench.run once and bench.overhead"
    args = run.build_parser().parse_args(runs[0])  # an unknown flag or variant exits here
    assert args.device == "cuda" and args.dtype == "bfloat16"
    # The cosine decay runs over the time cap, whatever a step costs there (a step count could outlast the cap).
    assert args.train_steps is None and args.decay_over == "budget"
    for call in overheads:
        assert overhead.build_parser().parse_args(call).device == "cuda"


def test_gpu_heal_script_passes_only_arguments_its_commands_accept():
    from bench import heal, measure

    script = ROOT / "bench" / "gpu_heal.sh"
    default = re.search(r'variant="\$\{VARIANT:-(\w+)\}"', script.read_text())
    assert default and default.group(1) == "lora_mlp_span"
    assert "VARIANT=lora_mlp_span_layer bench/gpu_heal.sh" in script.read_text()  # its usage line
    for variant in ("lora_mlp_span", "lora_mlp_span_layer"):  # the default and the one its usage line names
        (train,) = _script_commands(script, "bench.heal", {"variant": variant})
        args = heal.build_parser().parse_args(train)
        assert args.variant == variant and args.device == "cuda" and args.removal == [13, 14, 15, 16, 17, 18]
        assert "--seed" in train  # SEED reaches the training stream and the LoRA initialisation
    (read,) = _script_commands(script, "bench.measure")
    read_args = measure.build_parser().parse_args(read)
    assert read_args.device == "cuda" and read_args.dtype == "bfloat16" and read_args.eval_split == "test"
    # Both scripts share one setup (CUDA check, bundle unpack, project install).
    for name in ("gpu_bench.sh", "gpu_heal.sh"):
        assert 'source "$(dirname "$0")/gpu_env.sh"' in (ROOT / "bench" / name).read_text()


def test_heal_refuses_a_schedule_variant_and_a_trained_folder_before_loading_anything(tmp_path, monkeypatch):
    from bench import heal, real_vlm

    def no_build(*args, **kwargs):
        raise AssertionError("refused too late: the model was being built")

    monkeypatch.setattr(real_vlm, "build_real_vlm", no_build)
    with pytest.raises(SystemExit, match="routed_static trains a removal schedule"):
        heal.main(["routed_static", "--removal", "13", "14", "--runs", str(tmp_path)])
    (tmp_path / "lora_mlp_span").mkdir()
    (tmp_path / "lora_mlp_span" / "train_info.json").write_text("{}")
    with pytest.raises(SystemExit, match="already holds a trained adapter; delete the folder"):
        heal.main(["lora_mlp_span", "--removal", "13", "14", "--runs", str(tmp_path)])
    with pytest.raises(SystemExit, match="--set 'replacement_passes=8' names no RetrofitModule argument"):
        heal.main(["lora_mlp_span_layer", "--removal", "13", "--set", "replacement_passes=8", "--runs", str(tmp_path)])
    with pytest.raises(SystemExit, match="names a layer twice"):
        heal.main(["lora_mlp_span", "--removal", "13", "13", "--runs", str(tmp_path / "other")])
    with pytest.raises(SystemExit, match="gate skips per token .* leave out --removal"):
        heal.main(["gate", "--removal", "13", "--runs", str(tmp_path)])
    with pytest.raises(SystemExit, match="lora_mlp_span is a static variant: give the layers it removes"):
        heal.main(["lora_mlp_span", "--runs", str(tmp_path / "other")])


def test_heal_trains_the_variant_with_its_overrides_and_records_them(tmp_path, monkeypatch):
    from bench import data, heal, real_vlm, training, variants

    monkeypatch.setattr(data, "write_bench_shards", lambda: {})
    monkeypatch.setattr(real_vlm, "build_real_vlm", lambda: "vlm")
    monkeypatch.setattr(training, "training_shards", lambda manifest: {})
    calls = []
    monkeypatch.setattr(training, "train_variant", lambda variant, *a, **k: calls.append((variant, k)) or {"steps": 1})
    assert heal.main(["lora_mlp_span_layer", "--removal", "14", "13", "--set", "replacement_epochs=16",
                      "--seed", "3", "--runs", str(tmp_path)]) == 0
    variant, settings = calls[0]
    assert variant.module == {**variants.LAYER_HEALING, "replacement_epochs": 16}  # the rest of the recipe as it was
    assert settings["recorded"] == {"overrides": {"replacement_epochs": 16}} and settings["seed"] == 3
    assert settings["removal"] == {"removal_order": [14, 13], "max_removed_blocks": 2, "min_removed_blocks": 2}
    assert heal.main(["lora_mlp_span", "--removal", "13", "--runs", str(tmp_path)]) == 0
    assert calls[1][1]["recorded"] is None  # nothing overridden, nothing added
    # A per-token variant trains as bench.run trains it (no removal), with the seed given.
    assert heal.main(["gate_lora_candidates_b2", "--seed", "1", "--runs", str(tmp_path)]) == 0
    variant, settings = calls[2]
    assert variant == variants.VARIANTS["gate_lora_candidates_b2"]
    assert settings["removal"] == {} and settings["seed"] == 1


def test_heal_set_reads_json_values_and_text():
    from bench import heal

    assert heal.module_overrides(["replacement_epochs=8", "replacement_lr=1e-3", "replacement=layer"]) == {
        "replacement_epochs": 8, "replacement_lr": 1e-3, "replacement": "layer"}
    with pytest.raises(SystemExit, match="give KEY=VALUE"):
        heal.module_overrides(["replacement_epochs"])
