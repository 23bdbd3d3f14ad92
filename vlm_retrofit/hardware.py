"""Whether a device multiplies bfloat16 at speed, and the settings that keep bf16 off where it does not."""

from __future__ import annotations

import argparse
import functools
import platform
from pathlib import Path
from typing import Any, Sequence

import torch

BF16_NAMES = ("bfloat16", "bf16", "torch.bfloat16")
"""How a config names the bfloat16 dtype (`torch_dtype`, `--dtype`)."""

FP32_FIT_FLAGS = ("--trainer.precision", "32-true", "--model.torch_dtype", "float32")
"""The `fit` options that keep bf16 off (matmuls and frozen weights in fp32)."""


def fast_bf16(device: str = "cpu") -> bool:
    """Whether `device` ("cpu", "cuda", "cuda:1", ...) has fast kernels for bfloat16 matmuls.

    A CPU has them with AVX512 (oneDNN's bf16 kernels; native with AVX512-BF16 or AMX, where bf16-mixed steps ran
    1.25x the speed of fp32 ones). Without it (AVX2 only, as on many AMD EPYC and laptop parts) every bf16 matmul
    falls back to reference kernels: on one core of an AMD EPYC a 512 x 576 x 1536 matmul took 764 ms in bf16 (also
    under autocast) against 10.7 ms in fp32, so a bf16 run there is some 70x slower, not faster."""
    kind = torch.device(device).type
    if kind == "cuda":  # emulated bf16 (before Ampere) does not count
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return _cpu_has_fast_bf16() if kind == "cpu" else True  # other accelerators: their own business


def device_problem(device: str) -> str | None:
    """What stops a model from running on `device` here, as a refusal naming `--device` (None: nothing): a name torch
    does not parse, or an accelerator it cannot see."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        return f"--device {device!r} is not a device name torch knows ({error}); use cpu, cuda or cuda:N"
    if parsed.type == "cpu":
        return None
    backend = getattr(torch, parsed.type, None)  # torch.cuda, torch.mps, torch.xpu
    available = getattr(backend, "is_available", None)
    if not callable(available) or not available():
        return f"--device {device}: torch sees no {parsed.type} device on this machine; use --device cpu"
    count = getattr(backend, "device_count", None)
    if parsed.index is not None and callable(count) and parsed.index >= count():
        return f"--device {device}: torch sees {count()} {parsed.type} device(s), numbered from 0"
    return None


@functools.lru_cache(maxsize=1)
def _cpu_has_fast_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: judge by the vector unit torch dispatches to
        return "AVX512" in torch.backends.cpu.get_cpu_capability()


def cpu_description(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """This CPU as a measurement record names it: its model and the unit its bf16 matmuls run on, e.g. "AMD EPYC
    (AVX512-BF16, no AMX)". The unit sets much of a 20-minute training budget's step count: on 2 cores the bench's
    span recipe took 2.1 s a bf16-mixed step on a CPU with AMX and 3.8 s on an AMD EPYC with AVX512-BF16 alone
    (bench/HISTORY.md). Read from `cpuinfo` (Linux); elsewhere the platform's name and torch's vector capability."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():  # the first logical CPU's entry
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields["flags"].split()) if "flags" in fields else None
    if flags is None:
        unit = torch.backends.cpu.get_cpu_capability()
    elif "amx_bf16" in flags:
        unit = "AMX-BF16"
    elif "avx512_bf16" in flags:
        unit = "AVX512-BF16, no AMX"
    else:
        unit = f"{torch.backends.cpu.get_cpu_capability()}, no bf16 unit"
    return f"{model} ({unit})"


def _bf16_settings(precision: Any, torch_dtype: Any) -> list[str]:
    """The settings among a Lightning `precision` ("bf16-mixed", ...) and a weights `torch_dtype` that ask for bf16."""
    return [*([f"precision {precision}"] if str(precision).startswith("bf16") else []),
            *([f"torch_dtype {torch_dtype}"] if str(torch_dtype) in BF16_NAMES else [])]


def wants_bf16(precision: Any = None, torch_dtype: Any = None) -> bool:
    """Whether a Lightning `precision` ("bf16-mixed", "bf16-true", ...) or a weights `torch_dtype` asks for bf16."""
    return bool(_bf16_settings(precision, torch_dtype))


def slow_bf16_warning(device: str, precision: Any = None, torch_dtype: Any = None) -> str | None:
    """What to tell a user whose run asks for bf16 on a `device` that emulates it; None where nothing is wrong."""
    asked = ", ".join(_bf16_settings(precision, torch_dtype))
    if not asked or fast_bf16(device):
        return None
    if torch.device(device).type == "cpu":
        why = "this CPU has no fast kernels for (no AVX512): bf16 matmuls here run some 70x slower than fp32"
    else:
        why = f"{device} only emulates (bf16 runs slower there than fp32)"
    return f"this run asks for bf16 ({asked}), which {why}. Pass {' '.join(FP32_FIT_FLAGS)} to run in fp32"


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_retrofit.hardware", description=__doc__)
    parser.add_argument("--fit-flags", action="store_true",
                        help="print the `fit` options that keep bf16 off where this machine's CPU emulates it "
                             "(nothing where it multiplies bf16 at speed): `fit ... $(python -m "
                             "vlm_retrofit.hardware --fit-flags)`")
    ns = parser.parse_args(args)
    if ns.fit_flags:
        print("" if fast_bf16("cpu") else " ".join(FP32_FIT_FLAGS))
    else:
        print(f"bf16 at speed on cpu: {fast_bf16('cpu')} ({cpu_description()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
