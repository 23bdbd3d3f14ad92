"""C source of the fused routing kernels (`routing.native`), and of their CPython extension front."""

# Decoding one token runs a router in front of every block: about ten tiny PyTorch ops whose dispatch costs
# far more than their arithmetic (K x d multiply-adds). Each function below does one whole step in a single
# call, in fp32, with the same function as the PyTorch path (see SourceStack / DepthRouter._mix_buffered).
# Sums run over the hidden dimension in eight interleaved lanes so the compiler can vectorise them
# without -ffast-math (which would also break the -inf handling of absent sources). Rows are scored and mixed four
# at a time, each in its own order: a router's arithmetic on a token does not depend on what else is in the batch.
SOURCE = r"""
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
MODULE_NAME = "_vlm_retrofit_routing"
MODULE_HEAD = "#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n"  # before any standard header, as Python asks
MODULE_TAIL = r"""
/* Arguments as the ctypes front takes them: 'p' an address (int) or None for NULL, 'i' an integer. */
typedef union {
    void* p;
    int64_t i;
} vr_arg;

static int vr_unpack(PyObject* const* args, Py_ssize_t n, const char* kinds, vr_arg* out) {
    const Py_ssize_t want = (Py_ssize_t)strlen(kinds);
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
    if (vr_unpack(args, n, "pipp", a)) return NULL;
    vr_push_delta(a[0].p, a[1].i, a[2].p, a[3].p);
    Py_RETURN_NONE;
}

static PyObject* py_route(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    vr_arg a[9];
    if (vr_unpack(args, n, "piiippppp", a)) return NULL;
    vr_route(a[0].p, a[1].i, a[2].i, (int)a[3].i, a[4].p, a[5].p, a[6].p, a[7].p, a[8].p);
    Py_RETURN_NONE;
}

static PyObject* py_push_route(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    vr_arg a[11];
    if (vr_unpack(args, n, "pippiippppp", a)) return NULL;
    vr_push_route(a[0].p, a[1].i, a[2].p, a[3].p, a[4].i, (int)a[5].i, a[6].p, a[7].p, a[8].p, a[9].p, a[10].p);
    Py_RETURN_NONE;
}

static PyObject* py_push_route_whole(PyObject* self, PyObject* const* args, Py_ssize_t n) {
    vr_arg a[6];
    if (vr_unpack(args, n, "pippip", a)) return NULL;
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
