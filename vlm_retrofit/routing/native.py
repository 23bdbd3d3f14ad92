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

log = logging.getLogger(__name__)

ENV_SWITCH = "VLM_RETROFIT_NATIVE_ROUTING"
"""Set to 0 to keep decode-time routing in PyTorch ops (the fused kernels are used when they build)."""

# Decoding one token runs a router in front of every block: about ten tiny PyTorch ops whose dispatch costs
# far more than their arithmetic (K x d multiply-adds). Each function below does one whole step in a single
# call, in fp32, with the same function as the PyTorch path (see SourceStack / DepthRouter._mix_buffered).
# Sums run over the hidden dimension in eight interleaved lanes so the compiler can vectorise them
# without -ffast-math (which would also break the -inf handling of absent sources). Rows are scored and mixed four
# at a time, each in its own order: a router's arithmetic on a token does not depend on what else is in the batch.
_SOURCE = r"""
#include <math.h>
#include <stdint.h>

static float dot_lanes(const float* a, const float* b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[j + l] * b[j + l];
    float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < n; ++j) total += a[j] * b[j];
    return total;
}

/* dot_lanes of four rows a[0..3] with one vector b into out[0..3]: each row summed in dot_lanes' own order (the
   same bits: lane l of its accumulator takes elements l, l + 8, ...), four rows' additions in flight at once where a
   single row waits on its previous addition. Written with vector types: the compiler left the plain loop serial. */
typedef float vr_f4 __attribute__((vector_size(16), aligned(4), may_alias));

static void dot_lanes4(const float* const* a, const float* b, int64_t n, float* const* out) {
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3];
    vr_f4 lo0 = {0, 0, 0, 0}, hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const vr_f4 wl = *(const vr_f4*)(b + j), wh = *(const vr_f4*)(b + j + 4);
        lo0 += *(const vr_f4*)(a0 + j) * wl;
        hi0 += *(const vr_f4*)(a0 + j + 4) * wh;
        lo1 += *(const vr_f4*)(a1 + j) * wl;
        hi1 += *(const vr_f4*)(a1 + j + 4) * wh;
        lo2 += *(const vr_f4*)(a2 + j) * wl;
        hi2 += *(const vr_f4*)(a2 + j + 4) * wh;
        lo3 += *(const vr_f4*)(a3 + j) * wl;
        hi3 += *(const vr_f4*)(a3 + j + 4) * wh;
    }
    const vr_f4 lows[4] = {lo0, lo1, lo2, lo3}, highs[4] = {hi0, hi1, hi2, hi3};
    for (int r = 0; r < 4; ++r) {
        const vr_f4 l = lows[r], h = highs[r];
        float total = ((l[0] + l[1]) + (l[2] + l[3])) + ((h[0] + h[1]) + (h[2] + h[3]));
        for (int64_t i = j; i < n; ++i) total += a[r][i] * b[i];
        *out[r] = total;
    }
}

/* m += e[0] * v[0], then += e[1] * v[1], ... for g rows: the same roundings as g passes of m[j] += e[r] * v[r][j] in
   that order, with m read and written once (four rows at a time). */
static void mix_rows(float* m, const float* const* v, const float* e, int g, int64_t n) {
    int r = 0;
    for (; r + 4 <= g; r += 4) {
        const float *v0 = v[r], *v1 = v[r + 1], *v2 = v[r + 2], *v3 = v[r + 3];
        const float e0 = e[r], e1 = e[r + 1], e2 = e[r + 2], e3 = e[r + 3];
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            vr_f4 x = *(vr_f4*)(m + j);
            x += *(const vr_f4*)(v0 + j) * e0;
            x += *(const vr_f4*)(v1 + j) * e1;
            x += *(const vr_f4*)(v2 + j) * e2;
            x += *(const vr_f4*)(v3 + j) * e3;
            *(vr_f4*)(m + j) = x;
        }
        for (; j < n; ++j) m[j] = (((m[j] + v0[j] * e0) + v1[j] * e1) + v2[j] * e2) + v3[j] * e3;
    }
    for (; r < g; ++r)
        for (int64_t j = 0; j < n; ++j) m[j] += e[r] * v[r][j];
}

typedef struct {
    float* values;    /* [capacity, tokens, width]: the sources */
    float* inv_rms;   /* [capacity, tokens]: their inverse RMS */
    uint8_t* present; /* [capacity, tokens]: which tokens have each source */
    float* routed;    /* [capacity, tokens, width]: row r = the r-th router's output */
    float* alpha;     /* [capacity, capacity, tokens]: row r = the r-th router's weights, [k, tokens] used */
    float* gate_run;  /* [capacity, tokens]: row r = a skip gate's run probability on the r-th router's output */
    int64_t capacity, tokens, width;
    float eps;
} vr_stream;

/* Source `slot` = output - routed_input ([tokens, width] each; routed_input NULL: output itself, the decoder
   input), and its inverse RMS. */
void vr_push_delta(const vr_stream* s, int64_t slot, const float* output, const float* routed_input) {
    for (int64_t t = 0; t < s->tokens; ++t) {
        const float* o = output + t * s->width;
        float* d = s->values + (slot * s->tokens + t) * s->width;
        if (routed_input) {
            const float* r = routed_input + t * s->width;
            for (int64_t j = 0; j < s->width; ++j) d[j] = o[j] - r[j];
        } else {
            for (int64_t j = 0; j < s->width; ++j) d[j] = o[j];
        }
        s->inv_rms[slot * s->tokens + t] = 1.0f / sqrtf(dot_lanes(d, d, s->width) / (float)s->width + s->eps);
    }
}

/* Router over the first k sources into row `row`: alpha = softmax over the present sources of
   bias[slot_index[i] or i] + (values_i . scorer) * inv_rms_i (bias NULL: none; present consulted only when
   any_absent), routed = count * sum_i alpha_i * values_i with count = sources present at the token. With a skip
   gate (gate not NULL: its query times its norm gain), also gate_run = sigmoid((routed . gate) * inv_rms(routed)
   + gate_bias[0]), the gate's run probability for the block the routed input feeds. */
#define VR_CHUNK 64
#define VR_CHUNK_FLOATS 262144 /* 1 MiB of source rows per chunk: scored, then mixed while still in the cache */

void vr_route(const vr_stream* s, int64_t k, int64_t row, int any_absent, const float* scorer,
              const float* bias, const int64_t* slot_index, const float* gate, const float* gate_bias) {
    const int64_t tokens = s->tokens, width = s->width;
    float* alpha = s->alpha + row * s->capacity * tokens;
    /* Tokens in chunks small enough that all the chunk's source rows stay in the cache between two passes: every
       score first (into alpha), four rows at a time, so that the sums of several rows are in flight (one token's
       sources when decoding, several tokens' in a prefill); then each token's softmax and its mix, source by source
       in the stream's order. At uniform routing every weight is exactly 1 and the final factor count / total
       exactly 1, so the mix is the residual stream's own sum, bit for bit (identity at init).
       One thread: a prefill's tokens split over two threads ran slower inside a model (torch's OpenMP workers
       spin on the other cores for a while after each layer's kernels). */
    int64_t chunk = VR_CHUNK_FLOATS / (k * width > 0 ? k * width : 1);
    chunk = chunk < 1 ? 1 : (chunk > VR_CHUNK ? VR_CHUNK : chunk);
    float top[VR_CHUNK], count[VR_CHUNK], total[VR_CHUNK];
    for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
        const int64_t n = tokens - t0 < chunk ? tokens - t0 : chunk;
        float* routed = s->routed + (row * tokens + t0) * width;
        for (int64_t j = 0; j < n * width; ++j) routed[j] = 0.0f;
        /* Pass 1: the dot product of every present row with the scorer, into its alpha slot. */
        const float* pending[4];
        float* into[4];
        int waiting = 0;
        for (int64_t i = 0; i < k; ++i)
            for (int64_t t = t0; t < t0 + n; ++t) {
                if (any_absent && !s->present[i * tokens + t]) continue;
                pending[waiting] = s->values + (i * tokens + t) * width;
                into[waiting++] = alpha + i * tokens + t;
                if (waiting == 4) {
                    dot_lanes4(pending, scorer, width, into);
                    waiting = 0;
                }
            }
        for (int w = 0; w < waiting; ++w) *into[w] = dot_lanes(pending[w], scorer, width);
        /* The logits (-inf where absent), each token's largest and its count of present sources. */
        for (int64_t c = 0; c < n; ++c) {
            top[c] = -INFINITY;
            count[c] = 0.0f;
            total[c] = 0.0f;
        }
        for (int64_t i = 0; i < k; ++i) {
            const float source_bias = bias ? bias[slot_index ? slot_index[i] : i] : 0.0f;
            for (int64_t c = 0; c < n; ++c) {
                const int64_t t = t0 + c;
                float* a = alpha + i * tokens + t;
                if (any_absent && !s->present[i * tokens + t]) {
                    *a = -INFINITY;
                    continue;
                }
                float logit = *a * s->inv_rms[i * tokens + t];
                if (bias) logit += source_bias;
                *a = logit;
                count[c] += 1.0f;
                if (logit > top[c]) top[c] = logit;
            }
        }
        /* Pass 2: weights exp(logit - largest) into alpha; each token's rows mixed in with their weights, in order. */
        for (int64_t c = 0; c < n; ++c) {
            const int64_t t = t0 + c;
            const float* rows[4];
            float weights[4];
            int g = 0;
            for (int64_t i = 0; i < k; ++i) {
                float* a = alpha + i * tokens + t;
                /* A -inf score (absent, or a -inf source bias) weighs 0, also where every score is -inf. */
                const float e = *a == -INFINITY ? 0.0f : expf(*a - top[c]);
                *a = e;
                total[c] += e;
                if (e == 0.0f) continue;  /* a source of weight 0 adds nothing, not even 0 * inf */
                rows[g] = s->values + (i * tokens + t) * width;
                weights[g++] = e;
                if (g == 4) {
                    mix_rows(routed + c * width, rows, weights, g, width);
                    g = 0;
                }
            }
            mix_rows(routed + c * width, rows, weights, g, width);
        }
        for (int64_t i = 0; i < k; ++i)
            for (int64_t c = 0; c < n; ++c) alpha[i * tokens + t0 + c] /= total[c];
        /* routed = count * sum_i alpha_i * values_i: the mix times count / total. */
        for (int64_t c = 0; c < n; ++c) {
            if (count[c] == 0.0f) continue;
            const float factor = count[c] / total[c];
            float* m = routed + c * width;
            for (int64_t j = 0; j < width; ++j) m[j] *= factor;
        }
        if (gate)
            for (int64_t c = 0; c < n; ++c) {
                const float* m = routed + c * width;
                float inv_rms = 1.0f / sqrtf(dot_lanes(m, m, width) / (float)width + s->eps);
                float logit = dot_lanes(m, gate, width) * inv_rms + gate_bias[0];
                s->gate_run[row * tokens + t0 + c] = 1.0f / (1.0f + expf(-logit));
            }
    }
}

/* A block's delta into source `slot`, then the router over the first slot + 1 sources into row `row` (with the
   slots of the stored sources and a skip gate where given): one call for the two steps of a decoder layer's hook. */
void vr_push_route(const vr_stream* s, int64_t slot, const float* output, const float* routed_input, int64_t row,
                   int any_absent, const float* scorer, const float* bias, const int64_t* slot_index,
                   const float* gate, const float* gate_bias) {
    vr_push_delta(s, slot, output, routed_input);
    vr_route(s, slot + 1, row, any_absent, scorer, bias, slot_index, gate, gate_bias);
}

/* A router's parameters, packed once per forward: a whole forward's call per layer then passes one pointer. */
typedef struct {
    const float* scorer;
    const float* bias;
} vr_router;

/* vr_push_route for a forward that runs every block for every token: no absent tokens, dropped sources or gate. */
void vr_push_route_whole(const vr_stream* s, int64_t slot, const float* output, const float* routed_input,
                         int64_t row, const vr_router* router) {
    vr_push_delta(s, slot, output, routed_input);
    vr_route(s, slot + 1, row, 0, router->scorer, router->bias, 0, 0, 0);
}
"""

# The same entry points as a CPython extension module, where Python's headers are installed. Called between layers
# whose weights evict every cache, a ctypes call (libffi and per-argument converters) took ~5 us before its kernel
# started; a METH_FASTCALL function reading its integers took ~0.8 us (SmolLM2 decode, 2-core Xeon).
_MODULE_NAME = "_vlm_retrofit_routing"
_MODULE_HEAD = "#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n"  # before any standard header, as Python asks
_MODULE_TAIL = r"""
/* Arguments as the ctypes front takes them: 'p' an address (int) or None for NULL, 'i' an integer. */
typedef union {
    void* p;
    int64_t i;
} vr_arg;

static int vr_unpack(PyObject* const* args, Py_ssize_t n, const char* kinds, Py_ssize_t want, vr_arg* out) {
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, n);
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; ++j) {
        if (kinds[j] == 'p')
            out[j].p = args[j] == Py_None ? NULL : PyLong_AsVoidPtr(args[j]);
        else
            out[j].i = PyLong_AsLongLong(args[j]);
    }
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject* py_push_delta(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    vr_arg a[4];
    if (vr_unpack(args, n, "pipp", 4, a)) return NULL;
    vr_push_delta(a[0].p, a[1].i, a[2].p, a[3].p);
    Py_RETURN_NONE;
}

static PyObject* py_route(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    vr_arg a[9];
    if (vr_unpack(args, n, "piiippppp", 9, a)) return NULL;
    vr_route(a[0].p, a[1].i, a[2].i, (int)a[3].i, a[4].p, a[5].p, a[6].p, a[7].p, a[8].p);
    Py_RETURN_NONE;
}

static PyObject* py_push_route(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    vr_arg a[11];
    if (vr_unpack(args, n, "pippiippppp", 11, a)) return NULL;
    vr_push_route(a[0].p, a[1].i, a[2].p, a[3].p, a[4].i, (int)a[5].i, a[6].p, a[7].p, a[8].p, a[9].p, a[10].p);
    Py_RETURN_NONE;
}

static PyObject* py_push_route_whole(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    vr_arg a[6];
    if (vr_unpack(args, n, "pippip", 6, a)) return NULL;
    vr_push_route_whole(a[0].p, a[1].i, a[2].p, a[3].p, a[4].i, a[5].p);
    Py_RETURN_NONE;
}

static PyMethodDef vr_methods[] = {
    {"vr_push_delta", (PyCFunction)(void (*)(void))py_push_delta, METH_FASTCALL, NULL},
    {"vr_route", (PyCFunction)(void (*)(void))py_route, METH_FASTCALL, NULL},
    {"vr_push_route", (PyCFunction)(void (*)(void))py_push_route, METH_FASTCALL, NULL},
    {"vr_push_route_whole", (PyCFunction)(void (*)(void))py_push_route_whole, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef vr_module = {PyModuleDef_HEAD_INIT, "_vlm_retrofit_routing", NULL, -1, vr_methods};

PyMODINIT_FUNC PyInit__vlm_retrofit_routing(void) { return PyModule_Create(&vr_module); }
"""

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
            raise RuntimeError(f"{' '.join(command[:1])} failed: {error}") from error
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:1])} failed: {result.stderr.strip()[:500]}")
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
        source = _MODULE_HEAD + _SOURCE + _MODULE_TAIL
        command = [*compiler, *_FLAGS, f"-I{include}"]
        if sys.platform == "darwin":
            command += ["-undefined", "dynamic_lookup"]  # the interpreter provides Python's symbols
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    else:
        source, command, suffix = _SOURCE, [*compiler, *_FLAGS], ".so"
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
    loader = importlib.machinery.ExtensionFileLoader(_MODULE_NAME, str(target))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(_MODULE_NAME, loader))
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
