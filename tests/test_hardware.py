"""bf16 where the device has fast kernels for it: detection, the warning a run gets, the demo's fp32 options."""

import re
from pathlib import Path

import pytest
import torch

from vlm_retrofit import hardware
from vlm_retrofit.hardware import FP32_FIT_FLAGS, fast_bf16, slow_bf16_warning, wants_bf16

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Set whether this CPU counts as having fast bf16 kernels."""
    def set_to(value: bool) -> None:
        monkeypatch.setattr(hardware, "_cpu_has_fast_bf16", lambda: value)
    return set_to


def test_the_cpu_reading_follows_onednn_and_other_devices_are_not_judged(cpu_bf16):
    assert isinstance(fast_bf16(), bool)
    assert fast_bf16("cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    cpu_bf16(False)
    assert not fast_bf16("cpu") and fast_bf16("mps")
    if not torch.cuda.is_available():
        assert not fast_bf16("cuda")


def test_a_bf16_run_on_a_cpu_without_fast_kernels_is_told_how_to_run_in_fp32(cpu_bf16):
    cpu_bf16(False)
    assert wants_bf16("bf16-mixed") and wants_bf16(torch_dtype="bfloat16") and not wants_bf16("32-true", "float32")
    message = slow_bf16_warning("cpu", "bf16-mixed", None)
    assert "(precision bf16-mixed)" in message
    assert " ".join(FP32_FIT_FLAGS) in message
    assert "torch_dtype bfloat16" in slow_bf16_warning("cpu", "32-true", "bfloat16")
    assert slow_bf16_warning("cpu", "32-true", None) is None
    cpu_bf16(True)
    assert slow_bf16_warning("cpu", "bf16-mixed", "bfloat16") is None
    if not torch.cuda.is_available():  # a GPU without bf16 kernels (here: none at all) is told as a GPU
        assert "cuda only emulates" in slow_bf16_warning("cuda", "bf16-mixed")


def test_the_demo_gets_fp32_options_only_where_bf16_is_slow_and_fit_takes_them(cpu_bf16, capsys, tmp_path):
    from conftest import fit_config

    cpu_bf16(True)
    assert hardware.main(["--fit-flags"]) == 0 and capsys.readouterr().out.strip() == ""
    cpu_bf16(False)
    assert hardware.main(["--fit-flags"]) == 0 and capsys.readouterr().out.split() == list(FP32_FIT_FLAGS)
    assert "vlm_retrofit.hardware --fit-flags" in (ROOT / "Makefile").read_text()
    # The options are valid `fit` settings, and a bf16 run on such a CPU is warned about before it starts.
    fit_config(tmp_path, "tiny.yaml", "--trainer.max_steps", "1", *FP32_FIT_FLAGS)
    with pytest.warns(UserWarning, match=re.escape(" ".join(FP32_FIT_FLAGS))):
        fit_config(tmp_path, "tiny.yaml", "--trainer.max_steps", "1", "--trainer.precision", "bf16-mixed",
                   "--trainer.default_root_dir", str(tmp_path / "bf16"))


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
model name\t: {model}
flags\t\t: fpu sse2 avx2 {flags}

processor\t: 1
model name\t: another entry, not read
flags\t\t: amx_bf16
"""


@pytest.mark.parametrize(("flags", "unit"), [
    ("avx512f avx512_bf16 amx_tile amx_bf16", "(AMX-BF16)"),
    ("avx512f avx512_bf16", "(AVX512-BF16, no AMX)"),
    ("fma", ", no bf16 unit)"),
])
def test_a_record_names_the_cpu_model_and_its_bf16_unit(tmp_path, flags, unit):
    """The bf16 unit sets how many steps a 20-minute budget holds: records name it beside the model."""
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.format(vendor="AuthenticAMD", model="AMD EPYC 9R14", flags=flags))
    description = hardware.cpu_description(path)
    assert description.startswith("AMD EPYC 9R14 (") and description.endswith(unit)


def test_without_cpuinfo_the_record_falls_back_to_the_platform_and_torchs_capability(tmp_path):
    description = hardware.cpu_description(tmp_path / "missing")
    assert description.endswith(f"({torch.backends.cpu.get_cpu_capability()})") and len(description) > 4
