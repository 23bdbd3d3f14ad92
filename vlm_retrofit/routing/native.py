"""Fused CPU kernels for decode-time routing: one C call per layer (its delta push and router), optional."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from .native_source import MODULE_HEAD, MODULE_NAME, MODULE_TAIL, SOURCE

log = logging.getLogger(__name__)

ENV_SWITCH = "VLM_RETROFIT_NATIVE_ROUTING"
"""Set to 0 to keep decode-time routing in PyTorch ops (the fused kernels are used when they build)."""

# No fused multiply-adds (clang contracts a * b + c by default where the target has them): the kernels' roundings
# are those written, the same in every row grouping and on every machine. The architecture's baseline instructions:
# built with -march=native (AVX-512) the kernels ran slower on a 2-core Xeon.
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off"]
_lock = threading.Lock()
_library: Any = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "vlm_retrofit"


def _private_folder(folder: Path) -> None:
    # The library is loaded from here: a folder others can write to could hand us their code.
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = folder.stat()
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise RuntimeError(f"{folder} is not private to this user (owner or group/other write access)")


def _compile(command: list[str], source_text: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source = Path(work) / "routing.c"
        source.write_text(source_text)
        built = Path(work) / target.name
        try:
            result = subprocess.run([*command, str(source), "-o", str(built), "-lm"],
                                    capture_output=True, text=True, timeout=120)
        except subprocess.SubprocessError as error:
            raise RuntimeError(f"{command[0]} failed: {error}") from error
        if result.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)  # atomic: concurrent builders never load a half-written file


def _python_headers() -> str | None:
    """The folder holding this Python's `Python.h`, where installed (many runtime images leave it out)."""
    include = sysconfig.get_paths().get("include")
    return include if include and os.path.isfile(os.path.join(include, "Python.h")) else None


def _build_front(compiler: list[str], front: str) -> Any:
    """Compile (once per machine, cached) and load the kernels with one calling front: `module`, a CPython
    extension (needs Python's headers), or `ctypes`, a plain shared library."""
    if front == "module":
        include = _python_headers()
        if include is None:
            raise RuntimeError("Python's headers (Python.h) are not installed")
        source = MODULE_HEAD + SOURCE + MODULE_TAIL
        command = [*compiler, *_FLAGS, f"-I{include}"]
        if sys.platform == "darwin":
            command += ["-undefined", "dynamic_lookup"]  # the interpreter provides Python's symbols
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    else:
        source, command, suffix = SOURCE, [*compiler, *_FLAGS], ".so"
    # A shared home may serve other machines and Pythons: their builds get their own names.
    key = [source, *command, sys.platform, platform.machine(), sys.version]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    folder = _cache_dir()
    _private_folder(folder)
    target = folder / f"routing-{digest}{suffix}"
    load = _load_module if front == "module" else _load_ctypes
    if not target.exists():
        _compile(command, source, target)
    try:
        return load(target)
    except (OSError, ImportError, AttributeError):  # a damaged cached file: build it again, once
        target.unlink(missing_ok=True)
        _compile(command, source, target)
        return load(target)


def _build(fronts: tuple[str, ...] = ("module", "ctypes")) -> Any:
    """The kernels through the first calling front in `fronts` that builds."""
    compiler = shlex.split(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC)")
    failures = []
    for front in fronts:
        try:
            return _build_front(compiler, front)
        except (OSError, ImportError, RuntimeError, AttributeError) as error:
            failures.append(f"{front}: {error}")
    raise RuntimeError("; ".join(failures))


def _load_module(target: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(target))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(MODULE_NAME, loader))
    loader.exec_module(module)
    return module


def _load_ctypes(target: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.vr_push_delta.argtypes = [ptr, i64, ptr, ptr]
    library.vr_push_delta.restype = None
    library.vr_route.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, ptr, ptr]
    library.vr_route.restype = None
    library.vr_push_route.argtypes = [ptr, i64, ptr, ptr, i64, ctypes.c_int, ptr, ptr, ptr, ptr, ptr]
    library.vr_push_route.restype = None
    library.vr_push_route_whole.argtypes = [ptr, i64, ptr, ptr, i64, ptr]
    library.vr_push_route_whole.restype = None
    return library


def library() -> Any:
    """The compiled kernels, built once per machine into ~/.cache/vlm_retrofit; None where they cannot be. Its
    `vr_*` functions take the C functions' arguments, addresses as ints (None for NULL); called through a CPython
    extension where Python's headers are installed, else through ctypes."""
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            if os.environ.get(ENV_SWITCH, "1") != "0":
                try:
                    _library = _build()
                except (OSError, RuntimeError, AttributeError) as error:
                    log.info("decode-time routing stays in PyTorch ops: %s", error)
            _tried = True
    return _library


def usable(first: Tensor) -> bool:
    """Whether a buffered stream whose decoder input is `first` can route through the fused kernels."""
    return first.device.type == "cpu" and first.dtype == torch.float32 and library() is not None


class StreamBuffers:
    """Memory for the buffers of fused-kernel streams, kept between forwards of one adapter.

    A prefill's stream is megabytes (SmolLM2, 84 tokens: two [31, 84, 576] fp32 buffers, 12 MB) that the allocator
    hands back to the system when the stream goes, so the next prefill's stream faults in every page again: 6 ms a
    prompt on a 2-core machine, about as long as its routing. Here each buffer is a view of a kept flat tensor, taken
    only where nothing else holds it (the storage's use count shows views still alive); otherwise, or where this
    torch cannot tell, a new one is made and kept if larger. What stays is the largest stream's buffers."""

    def __init__(self) -> None:
        self._flat: dict[str, Tensor] = {}

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised CPU tensor of `shape` for buffer `name`, in kept memory where it is free."""
        numel = 1
        for size in shape:
            numel *= size
        flat = self._flat.get(name)
        # Memory made under inference_mode cannot be written outside it (a Lightning validation, then generate).
        if (flat is None or flat.dtype != dtype or flat.numel() < numel or _storage_use_count is None
                or flat.is_inference() != torch.is_inference_mode_enabled()
                or _storage_use_count(flat.untyped_storage()._cdata) != _SOLE_USERS):
            flat = torch.empty(max(numel, 1), dtype=dtype, device="cpu")  # not the default device: C writes it
            if _storage_use_count is not None and (name not in self._flat or self._flat[name].numel() <= numel):
                self._flat[name] = flat
        return flat[:numel].view(shape)


def stream_buffer(buffers: StreamBuffers | None, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor for a fused-kernel stream's buffer `name`: from `buffers`, or new (None)."""
    return buffers.empty(name, shape, dtype) if buffers is not None else torch.empty(shape, dtype=dtype, device="cpu")


class NativeStream:
    """The buffers of one buffered fp32 CPU stream as the C kernels see them; each step is one foreign call.

    Every router writes its own rows of `routed` and `alpha`, so its outputs stay valid for the whole forward
    without a per-call allocation. At decode time this runs once per layer per token between memory-bound layer
    kernels that evict every cache, where each Python operation costs several times its warm price: hence plain
    attributes, output rows split once per forward, and router parameters checked once per forward by the caller.
    """

    def __init__(self, values: Tensor, inv_rms: Tensor, present: Tensor, shape: torch.Size, eps: float,
                 buffers: StreamBuffers | None = None) -> None:
        capacity, tokens, width = values.shape
        routed = self._routed = stream_buffer(buffers, "routed", (capacity, *shape), torch.float32)
        self.routed_rows = routed.unbind(0)
        """Row r: the r-th router's output, [B, T, d] (split once here: a view made per layer costs more)."""
        self.alpha = stream_buffer(buffers, "alpha", (capacity, capacity, *shape[:-1]), torch.float32)
        """Row r: the r-th router's weights, [K, B, T] for the first K sources it mixed."""
        self._gate_run = stream_buffer(buffers, "gate_run", (capacity, *shape[:-1]), torch.float32)
        """Row r: a skip gate's run probability [B, T] on the r-th router's output, where the call computed one."""
        self._gate_run_rows: tuple[Tensor, ...] | None = None  # split on first use: forwards without gates skip it
        self._struct = _Stream(values.data_ptr(), inv_rms.data_ptr(), present.data_ptr(), routed.data_ptr(),
                               self.alpha.data_ptr(), self._gate_run.data_ptr(), capacity, tokens, width, eps)
        self._address = ctypes.addressof(self._struct)
        self._keep = (values, inv_rms, present)  # the struct points into these
        self._capacity, self._width = capacity, width
        self._size = tokens * width
        self._push = _library.vr_push_delta
        self._route = _library.vr_route
        self._push_route = _library.vr_push_route
        self.routers_run = 0
        self._last_routed: Tensor | None = None
        self._row_sources = [0] * capacity
        """How many sources each row's router mixed."""
        self._row_gated = [False] * capacity
        """Whether each row's call computed a skip gate's run probability."""
        # The buffers' storages, taken once (their tensors are held here): a storage object per buffer and check cost
        # more than the counts.
        self._storages = tuple(buffer.untyped_storage()._cdata for buffer in (*self._keep, routed, self.alpha,
                                                                               self._gate_run))
        self._own_users = self._storage_users()
        """How many tensors share each buffer's storage when only this stream and its own row views hold them."""
        self._whole_routing: tuple[tuple, Callable[[int, Tensor, Tensor], int | None]] | None = None
        """The last `whole_routing` function and the parameters it packed."""

    def restart(self) -> bool:
        """Make the buffers ready for another forward, where nothing outside this stream holds a tensor the last one
        handed out (a router's output fed to a layer, routing weights, gate probabilities): those would change under
        their holder. False, with nothing changed, where something does or this torch cannot tell.

        A decoding step would otherwise allocate and split its buffers anew, between layers whose weights evict every
        cache: on SmolLM2 (block size 1) that was a third of a step's routing time."""
        users = self._storage_users()
        if users is None or users != self._own_users:
            return False
        # The rows handed out are this stream's own row objects: a caller keeping one (a layer's routed input kept by
        # a hook) adds a Python reference to it, not a storage user.
        self._last_routed = None
        if _rows_held(self.routed_rows) or (self._gate_run_rows is not None and _rows_held(self._gate_run_rows)):
            return False
        self.routers_run = 0
        self._row_gated = [False] * self._capacity
        return True

    def _storage_users(self) -> tuple[int, ...] | None:
        if _storage_use_count is None:
            return None
        return tuple(map(_storage_use_count, self._storages))

    def push_source(self, slot: int, source: Tensor) -> bool:
        """Source `slot` = `source` (the decoder input), as `push_delta` without the subtraction."""
        if not (slot < self._capacity and _is_plain(source, self._size)):
            return False
        self._push(self._address, slot, source.data_ptr(), None)
        return True

    def push_delta(self, slot: int, output: Tensor, routed_input: Tensor) -> bool:
        """Source `slot` = output - routed_input; False (nothing written) unless both are contiguous fp32 CPU
        tensors of the stream's size and the slot exists: the caller then uses PyTorch ops (which raise on misuse)."""
        if not self._can_push(slot, output, routed_input):
            return False
        self._push(self._address, slot, output.data_ptr(), routed_input.data_ptr())
        return True

    def route(self, k: int, num_slots: int, any_absent: bool, params: "KernelParams | None", slot_index: Tensor | None,
              gate: "KernelParams | None" = None) -> int | None:
        """Mix the first k stored sources (of `num_slots` written, dropped ones included; `slot_index` maps them)
        with a router's `params`, and run its `gate` where given on the result: the row it wrote (`routed_rows[row]`,
        `alpha_row(row)`, `gate_run_row(row)`). None where the kernels cannot take the parameters (`params` None)
        or the rows are used up: the caller then uses PyTorch ops."""
        row = self.routers_run
        if not self._can_route(row, num_slots, params):
            return None  # more routers than rows (a hook re-run) or unusual parameters: the PyTorch path
        gate_weight, gate_bias = self._gate_addresses(gate)
        self._route(self._address, k, row, any_absent, params.scorer_address, params.bias_address,
                    _bias_index(params, slot_index), gate_weight, gate_bias)
        return self._wrote(row, k, gate_weight is not None)

    def gate_run_row(self, row: int) -> Tensor | None:
        """The skip gate's run probability [B, T] the call of `row` computed, or None where it computed none."""
        if not self._row_gated[row]:
            return None
        if self._gate_run_rows is None:
            self._gate_run_rows = self._gate_run.unbind(0)
            self._own_users = self._storage_users()  # the rows are this stream's own views from now on
        return self._gate_run_rows[row]

    def alpha_row(self, row: int) -> Tensor:
        """The routing weights [K, B, T] the router of `row` wrote (K: the sources it mixed)."""
        return self.alpha[row, : self._row_sources[row]]

    def push_route(self, slot: int, output: Tensor, routed_input: Tensor, any_absent: bool,
                   params: "KernelParams | None", num_slots: int, slot_index: Tensor | None = None,
                   gate: "KernelParams | None" = None) -> int | None:
        """`push_delta` into `slot`, then `route` over sources 0..slot (`num_slots` written with this one, dropped
        ones included; `slot_index` maps them, None while none was), in one call: the row it wrote
        (`routed_rows[row]`, `alpha_row(row)`, `gate_run_row(row)`). None (nothing written) where either step would
        refuse its inputs: the caller then runs both."""
        row = self.routers_run
        # `_can_push` and `_can_route` written out: this runs once per layer per decoded token. A routed input that
        # is the previous router's row is known to be plain.
        if (params is None or row >= self._capacity or num_slots > self._capacity or params.width != self._width
                or (params.bias_address is not None and params.bias_length < num_slots)
                or output.dtype is not torch.float32 or not output.is_cpu or not output.is_contiguous()
                or output.numel() != self._size
                or (routed_input is not self._last_routed and not _is_plain(routed_input, self._size))):
            return None
        gate_weight, gate_bias = self._gate_addresses(gate)
        self._push_route(self._address, slot, output.data_ptr(), routed_input.data_ptr(), row, any_absent,
                         params.scorer_address, params.bias_address, _bias_index(params, slot_index), gate_weight,
                         gate_bias)
        return self._wrote(row, slot + 1, gate_weight is not None)

    def whole_routing(self, params: "list[KernelParams | None]") -> Callable[[int, Tensor, Tensor], int | None]:
        """`push_route` for a forward that runs every block for every token (no skip policy, nothing dropped or
        absent): `route(block, output, routed_input)` pushes block `block`'s delta into slot block + 1 and runs
        `params[block]`, the router after it, in one call whose router arguments were packed here once; the row it
        wrote, or None (nothing written) where the kernels cannot take it: the caller then takes the general path.

        The function is kept with the stream: the next forward on it (`restart`: a decoding step) passing the same
        parameter objects gets it back instead of packing 30 structs again."""
        cached = self._whole_routing
        if cached is not None and len(cached[0]) == len(params) and all(a is b for a, b in zip(cached[0], params)):
            return cached[1]
        capacity, width, size = self._capacity, self._width, self._size
        packed: list[_Router | None] = []
        for block, router in enumerate(params):
            # The router after `block` mixes block + 2 sources (s_0 and every delta up to the block's).
            usable = (router is not None and router.width == width and block + 2 <= capacity
                      and (router.bias_address is None or router.bias_length >= block + 2))
            packed.append(_Router(router.scorer_address, router.bias_address) if usable else None)
        addresses = [None if entry is None else ctypes.addressof(entry) for entry in packed]
        call, stream = _library.vr_push_route_whole, self._address
        # Kept on this stream, the function holds it weakly: a cycle would keep the buffers' memory in use (and out of
        # the next stream's reach) until the garbage collector ran.
        owner = weakref.ref(self)

        def route(block: int, output: Tensor, routed_input: Tensor) -> int | None:
            native = owner()
            row = native.routers_run
            address = addresses[block] if block < len(addresses) else None
            # Checked before the foreign call, as in `push_route`: a wrong size or layout would be read past in C.
            if (address is None or row >= capacity or output.dtype is not torch.float32 or not output.is_cpu
                    or not output.is_contiguous() or output.numel() != size
                    or (routed_input is not native._last_routed and not _is_plain(routed_input, size))):
                return None
            call(stream, block + 1, output.data_ptr(), routed_input.data_ptr(), row, address)
            return native._wrote(row, block + 2, False)

        route.packed = packed, params  # the structs and the tensors they point into live as long as the function
        self._whole_routing = tuple(params), route
        return route

    def _wrote(self, row: int, sources: int, gated: bool) -> int:
        """Record what the call into `row` wrote: a router over `sources` sources, with a gate or not."""
        self.routers_run = row + 1
        self._last_routed = self.routed_rows[row]
        self._row_sources[row] = sources
        self._row_gated[row] = gated
        return row

    # The checks run in Python before any foreign call: a wrong size or layout would be read past in C.
    def _can_push(self, slot: int, output: Tensor, routed_input: Tensor) -> bool:
        return slot < self._capacity and _is_plain(output, self._size) and _is_plain(routed_input, self._size)

    def _can_route(self, row: int, num_slots: int, params: "KernelParams | None") -> bool:
        return (params is not None and row < self._capacity and num_slots <= self._capacity
                and params.width == self._width and (params.bias_address is None or params.bias_length >= num_slots))

    def _gate_addresses(self, gate: "KernelParams | None") -> tuple[int | None, int | None]:
        """A skip gate's weight and bias addresses for the kernel; NULLs for none, or for one it cannot read (the
        policy then runs that gate in PyTorch ops)."""
        if gate is None or gate.width != self._width or gate.bias_address is None:
            return None, None
        return gate.scorer_address, gate.bias_address


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
"""How many tensors (views included) share a storage; without it (another torch) streams are never reused."""


def _sole_users() -> int | None:
    """The use count `_storage_use_count(t.untyped_storage()._cdata)` reads where `t` alone holds its storage."""
    if _storage_use_count is None:
        return None
    probe = torch.empty(1)  # named: a temporary's storage would be freed before its count is read
    return _storage_use_count(probe.untyped_storage()._cdata)


_SOLE_USERS = _sole_users()


def _most_row_refs(rows: tuple[Tensor, ...]) -> int:
    return max(map(sys.getrefcount, rows))


_FREE_ROW_REFS = _most_row_refs(torch.empty(2, 1).unbind(0))
"""`_most_row_refs` of rows that only their tuple holds."""


def _rows_held(rows: tuple[Tensor, ...]) -> bool:
    """Whether anything besides the tuple `rows` holds one of its tensors."""
    return _most_row_refs(rows) > _FREE_ROW_REFS


def _bias_index(params: "KernelParams", slot_index: Tensor | None) -> int | None:
    """The address of the slot of each stored source, where the router has source biases to map (else NULL)."""
    return None if slot_index is None or params.bias_address is None else slot_index.data_ptr()


class KernelParams(NamedTuple):
    """A router's or a skip gate's parameters as the kernels read them: addresses into contiguous fp32 CPU tensors
    (held here, so the addresses stay valid as long as this is)."""

    scorer_address: int
    """The query times the (key-)norm gain, [width]."""
    width: int
    bias_address: int | None
    """The router's source bias or the gate's bias, or None for a router without one."""
    bias_length: int
    tensors: tuple[Tensor, ...]

    @classmethod
    def of(cls, scorer: Tensor, bias: Tensor | None) -> "KernelParams | None":
        """None unless `scorer` and `bias` are contiguous fp32 CPU tensors."""
        if not _is_plain(scorer, scorer.numel()) or (bias is not None and not _is_plain(bias, bias.numel())):
            return None
        return cls(scorer.data_ptr(), scorer.numel(), None if bias is None else bias.data_ptr(),
                   0 if bias is None else bias.numel(), (scorer,) if bias is None else (scorer, bias))


def _is_plain(tensor: Tensor, size: int) -> bool:
    """A contiguous fp32 CPU tensor of `size` elements: what the kernels may read as a float array."""
    return tensor.dtype is torch.float32 and tensor.is_cpu and tensor.is_contiguous() and tensor.numel() == size


class _Router(ctypes.Structure):
    _fields_ = [("scorer", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Stream(ctypes.Structure):
    _fields_ = [("values", ctypes.c_void_p), ("inv_rms", ctypes.c_void_p), ("present", ctypes.c_void_p),
                ("routed", ctypes.c_void_p), ("alpha", ctypes.c_void_p), ("gate_run", ctypes.c_void_p),
                ("capacity", ctypes.c_int64),
                ("tokens", ctypes.c_int64), ("width", ctypes.c_int64), ("eps", ctypes.c_float)]
