/* Native kernels for the token store's lookups, with exactly the results of the numpy reference.
 *
 * The reference lives in store/match_kernels.py (scan_matches, extend_matches, continuations),
 * store/suffix_index.py (SuffixIndex.match), store/token_store.py (TokenStore.lookup) and
 * drafter_service/core/session.py (DraftSession.lookup). Arrays arrive through the buffer protocol; result
 * arrays are created with numpy.empty. The store and session lookups are also offered to other extensions
 * over raw arrays (the capsule ``_C_API``, see KernelsCAPI). Every entry point returns NotImplemented for
 * arguments it does not handle (unusual dtypes, negative or out-of-range token ids in a context,
 * budgets below one, ...), and the caller then runs the numpy reference, so both paths always agree.
 * The GIL is held throughout: calls take microseconds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_kernels_api.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86_TARGETS 1
#else
#define HAVE_X86_TARGETS 0
#endif

#define PREFETCH_AHEAD 32
#define STACK_TOKENS 256

static PyObject *np_empty;  /* numpy.empty */
static PyObject *dtype_i64; /* numpy.dtype("int64") */
static PyObject *dtype_i32; /* numpy.dtype("int32") */
static PyObject *dtype_u64; /* numpy.dtype("uint64") */

/* ---- small helpers -------------------------------------------------------------------------------- */

/* Set while a shared lookup runs on this thread (see KernelsCAPI): lookups then raise nothing, since the batched
 * step runs them on helper threads that have no Python thread state, and the step raises MemoryError for them. */
static _Thread_local int quiet;

/* Out of memory: MemoryError unless quiet (lookups' working memory comes from the raw allocator, which any thread
 * may use). Returns -1. */
static int nomem(void) {
    if (!quiet) PyErr_NoMemory();
    return -1;
}

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Vec;

static int vec_reserve(Vec *a, Py_ssize_t need) {
    if (need <= a->cap) return 0;
    Py_ssize_t c = a->cap ? a->cap : 64;
    while (c < need) c *= 2;
    int64_t *p = PyMem_RawRealloc(a->v, (size_t)c * sizeof(int64_t));
    if (p == NULL) return nomem();
    a->v = p;
    a->cap = c;
    return 0;
}

static inline int vec_push(Vec *a, int64_t x) {
    if (a->n == a->cap && vec_reserve(a, a->n + 1) < 0) return -1;
    a->v[a->n++] = x;
    return 0;
}

static void vec_free(Vec *a) {
    PyMem_RawFree(a->v);
    a->v = NULL;
    a->n = a->cap = 0;
}

static inline int64_t floor_mod(int64_t a, int64_t m) {
    int64_t r = a % m;
    return r < 0 ? r + m : r;
}

/* The ring buffer's slots: absolute position p lives in slot p mod cap. ``base`` is a multiple of cap
 * near the positions read, so most slots are found by a subtraction instead of a division. */
typedef struct {
    const int32_t *d;
    int64_t cap;
    int64_t base;
} Ring;

static inline int64_t ring_slot(const Ring *r, int64_t pos) {
    uint64_t s = (uint64_t)(pos - r->base);
    if (s < (uint64_t)r->cap) return (int64_t)s;
    if (s < 2 * (uint64_t)r->cap) return (int64_t)s - r->cap;
    return floor_mod(pos, r->cap);
}

static inline void ring_set_base(Ring *r, int64_t near) {
    r->base = near - floor_mod(near, r->cap);
}

/* Reads a Python int into *out; 0 when it is not an int or does not fit in int64 (no error left set). */
static int get_i64(PyObject *o, int64_t *out) {
    if (!PyLong_Check(o)) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = (int64_t)v;
    return 1;
}

/* Element kinds of integer buffers: itemsize, negated for unsigned types; 0 when unsupported. */
static int int_kind(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    else if (*f == '>' || *f == '!') return 0;
#if PY_BIG_ENDIAN
    if (v->format && v->format[0] == '<') return 0;
#endif
    if (f[0] == '\0' || f[1] != '\0') return 0;
    int sgn;
    switch (f[0]) {
        case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': sgn = 1; break;
        case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': sgn = -1; break;
        default: return 0;
    }
    Py_ssize_t s = v->itemsize;
    if (s != 1 && s != 2 && s != 4 && s != 8) return 0;
    if (sgn < 0 && s == 8) return 0; /* may not fit in int64 */
    return (int)(sgn * s);
}

static inline int64_t read_int(const char *p, int kind) {
    switch (kind) {
        case 1: { int8_t x; memcpy(&x, p, 1); return x; }
        case 2: { int16_t x; memcpy(&x, p, 2); return x; }
        case 4: { int32_t x; memcpy(&x, p, 4); return x; }
        case 8: { int64_t x; memcpy(&x, p, 8); return x; }
        case -1: { uint8_t x; memcpy(&x, p, 1); return x; }
        case -2: { uint16_t x; memcpy(&x, p, 2); return x; }
        default: { uint32_t x; memcpy(&x, p, 4); return x; }
    }
}

/* A one-dimensional integer array. */
typedef struct {
    Py_buffer view;
    int held;
    int kind;
    Py_ssize_t n, stride;
} IntArg;

/* 1: acquired; 0: not a 1-D integer buffer (no error set). */
static int int_arg(PyObject *o, IntArg *a) {
    a->held = 0;
    if (!PyObject_CheckBuffer(o)) return 0;
    if (PyObject_GetBuffer(o, &a->view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        return 0;
    }
    a->held = 1;
    a->kind = int_kind(&a->view);
    if (a->view.ndim != 1 || a->kind == 0) return 0;
    a->n = a->view.shape[0];
    a->stride = a->view.strides[0];
    return 1;
}

static inline int64_t int_at(const IntArg *a, Py_ssize_t i) {
    return read_int((const char *)a->view.buf + i * a->stride, a->kind);
}

static void int_release(IntArg *a) {
    if (a->held) PyBuffer_Release(&a->view);
    a->held = 0;
}

/* 1: a C-contiguous 1-D int32 array (the ring buffer, a session's tokens) of at least one slot. */
static int ring_arg(PyObject *o, IntArg *a) {
    if (!int_arg(o, a)) return 0;
    return a->kind == 4 && a->stride == 4 && a->n > 0;
}

/* A new C-contiguous numpy array; *data points at its first element. */
static PyObject *new_array(PyObject *dtype, Py_ssize_t d0, Py_ssize_t d1, int ndim, void **data) {
    PyObject *shape = ndim == 1 ? PyLong_FromSsize_t(d0) : Py_BuildValue("(nn)", d0, d1);
    if (shape == NULL) return NULL;
    PyObject *args[2] = {shape, dtype};
    PyObject *arr = PyObject_Vectorcall(np_empty, args, 2, NULL);
    Py_DECREF(shape);
    if (arr == NULL) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(arr, &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    *data = v.buf;
    PyBuffer_Release(&v); /* numpy keeps the data in place while the array lives */
    return arr;
}

static PyObject *i64_array(const int64_t *src, Py_ssize_t n) {
    void *data;
    PyObject *arr = new_array(dtype_i64, n, 0, 1, &data);
    if (arr != NULL && n) memcpy(data, src, (size_t)n * sizeof(int64_t));
    return arr;
}

static PyObject *not_implemented(void) {
    Py_RETURN_NOTIMPLEMENTED;
}

/* ---- the kernels ---------------------------------------------------------------------------------- */

/* Tokens matched at the occurrence ending at ``e``: ctx[j] == token at e - j for j in [from, result),
 * stopping at ``limit`` and below ``oldest``. */
static inline int64_t run_length(const Ring *r, int64_t e, const int64_t *ctx, int64_t from, int64_t limit,
                                 int64_t oldest) {
    int64_t j = from, pos = e - from;
    if (j >= limit || pos < oldest) return j;
    int64_t avail = pos - oldest + 1; /* positions pos, pos - 1, ..., oldest */
    if (avail > limit - j) avail = limit - j;
    int64_t slot = ring_slot(r, pos);
    while (avail > 0) {
        int64_t run = slot + 1 < avail ? slot + 1 : avail; /* slots slot, slot - 1, ... without wrapping */
        const int32_t *p = r->d + slot;
        const int64_t *c = ctx + j;
        for (int64_t t = 0; t < run; t++)
            if ((int64_t)p[-t] != c[t]) return j + t;
        j += run;
        avail -= run;
        slot = r->cap - 1;
    }
    return j;
}

/* extend_matches: keeps in ``ends`` the candidates matching the most tokens, in their order, and
 * returns that length (0 when no candidate is still held, -1 on error). more[i] (i < result - matched)
 * counts the candidates matching at least matched + i + 1 tokens. ctx holds at least ``limit`` tokens. */
static int64_t extend_core(const Ring *r, Vec *ends, const int64_t *ctx, int64_t matched, int64_t limit,
                           int64_t oldest, int64_t *more, Vec *lens) {
    Py_ssize_t c = ends->n, w = 0;
    int64_t *e = ends->v;
    for (Py_ssize_t i = 0; i < c; i++)
        if (e[i] - (matched - 1) >= oldest) e[w++] = e[i];
    ends->n = w;
    if (w == 0) return 0;
    if (matched >= limit) return matched;
    if (vec_reserve(lens, w) < 0) return -1;
    int64_t *len = lens->v, best = matched;
    for (Py_ssize_t i = 0; i < w && i < PREFETCH_AHEAD; i++) __builtin_prefetch(r->d + ring_slot(r, e[i] - matched));
    for (Py_ssize_t i = 0; i < w; i++) {
        if (i + PREFETCH_AHEAD < w) __builtin_prefetch(r->d + ring_slot(r, e[i + PREFETCH_AHEAD] - matched));
        int64_t l = run_length(r, e[i], ctx, matched, limit, oldest);
        len[i] = l;
        if (l > best) best = l;
    }
    int64_t span = best - matched;
    if (span) {
        memset(more, 0, (size_t)span * sizeof(int64_t));
        for (Py_ssize_t i = 0; i < w; i++)
            if (len[i] > matched) more[len[i] - matched - 1]++;
        for (int64_t j = span - 2; j >= 0; j--) more[j] += more[j + 1];
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < w; i++)
        if (len[i] == best) e[k++] = e[i];
    ends->n = k;
    return best;
}

/* ---- the suffix index handle ---------------------------------------------------------------------- */

/* A suffix-array entry i ends at absolute position end - 1 - sa[i]. Once the ring buffer has overwritten
 * positions below oldest > start, an occurrence of ``held`` tokens ending there is still held exactly
 * when end - 1 - sa[i] - (held - 1) >= oldest, i.e. when sa[i] <= n - 1 - (oldest + held - 1 - start):
 * a comparison against one threshold, so the index needs nothing beyond its two arrays to skip the
 * overwritten occurrences; a lookup that answers from such a range filters it in one vectorised pass
 * into a live map of its own (freed with the result). Index is immutable once built. Its one extra is a
 * table of where each value of the keys' top BUCKET_BITS bits begins (2**min(bits, BUCKET_BITS) + 1
 * uint32 entries, at most 16 KiB whatever the number of tokens): the first token's range when tokens
 * have at most BUCKET_BITS bits, else a bucket that every search starts in. */

#define BUCKET_BITS 12
#define MIN_BLOCK 64 /* entries (or blocks of the level below) under one block minimum */
#define MIN_LEVELS 3 /* blocks of 64, 4096 and 262144 entries */

typedef struct {
    PyObject_HEAD
    Py_buffer keys_view, sa_view;
    int held;  /* bit 0: keys_view, bit 1: sa_view */
    int ready; /* initialised and checked */
    const uint64_t *keys; /* (n,) sorted packed keys */
    const int32_t *sa;    /* (n,) reversed-suffix starts: entry i ends at position end - 1 - sa[i] */
    Py_ssize_t n;
    int64_t start, end;
    int bits, tpk;
    /* (2**bucket_bits + 1,) keys before each value of the top bucket_bits bits of the first token
     * (the whole token when bucket_bits == bits), or NULL */
    uint32_t *bucket;
    int bucket_bits;
    /* mins[l] (nmins[l] entries): the smallest sa of each block of MIN_BLOCK**(l + 1) entries, so that the most
     * recent occurrences of a large range are found without reading all of it (range_most_recent) */
    int32_t *mins[MIN_LEVELS];
    Py_ssize_t nmins[MIN_LEVELS];
    int levels;
} IndexObject;

static void index_dealloc(IndexObject *self) {
    PyMem_Free(self->bucket);
    for (int l = 0; l < MIN_LEVELS; l++) PyMem_Free(self->mins[l]);
    if (self->held & 1) PyBuffer_Release(&self->keys_view);
    if (self->held & 2) PyBuffer_Release(&self->sa_view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The block minima of the suffix array (see IndexObject.mins): one pass over it, then over each level; -1 on
 * error. Levels whose blocks would not fit in the array are left out. */
static int index_block_mins(IndexObject *self) {
    Py_ssize_t below = self->n;
    for (int l = 0; l < MIN_LEVELS && below >= 2 * MIN_BLOCK; l++) {
        Py_ssize_t cnt = (below + MIN_BLOCK - 1) / MIN_BLOCK;
        self->mins[l] = PyMem_Malloc((size_t)cnt * sizeof(int32_t));
        if (self->mins[l] == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->nmins[l] = cnt;
        self->levels = l + 1;
        below = cnt;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int l = 0; l < self->levels; l++) {
        const int32_t *src = l ? self->mins[l - 1] : self->sa;
        Py_ssize_t len = l ? self->nmins[l - 1] : self->n;
        int32_t *dst = self->mins[l];
        for (Py_ssize_t b = 0; b < self->nmins[l]; b++) {
            Py_ssize_t i = b * MIN_BLOCK, e = i + MIN_BLOCK < len ? i + MIN_BLOCK : len;
            int32_t v = src[i];
            for (i++; i < e; i++) v = src[i] < v ? src[i] : v;
            dst[b] = v;
        }
    }
    Py_END_ALLOW_THREADS
    return 0;
}

static int index_init(IndexObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"keys", "sa", "start", "end", "bits", "tokens_per_key", NULL};
    PyObject *keys, *sa;
    long long start, end;
    int bits, tpk;
    if (self->held) {
        PyErr_SetString(PyExc_TypeError, "Index is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLLii", names, &keys, &sa, &start, &end, &bits, &tpk))
        return -1;
    if (PyObject_GetBuffer(keys, &self->keys_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    self->held |= 1;
    if (PyObject_GetBuffer(sa, &self->sa_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    self->held |= 2;
    const char *kf = self->keys_view.format ? self->keys_view.format : "B";
    if (*kf == '@' || *kf == '=' || *kf == '<') kf++;
    if (self->keys_view.ndim != 1 || self->keys_view.itemsize != 8 || (kf[0] != 'Q' && kf[0] != 'L') ||
        kf[1] != '\0') {
        PyErr_SetString(PyExc_TypeError, "keys must be a contiguous 1-D uint64 array");
        return -1;
    }
    if (self->sa_view.ndim != 1 || int_kind(&self->sa_view) != 4) {
        PyErr_SetString(PyExc_TypeError, "sa must be a contiguous 1-D int32 array");
        return -1;
    }
    Py_ssize_t n = self->keys_view.shape[0];
    if (self->sa_view.shape[0] != n || end - start != n) {
        PyErr_SetString(PyExc_ValueError, "keys, sa and [start, end) differ in length");
        return -1;
    }
    if (bits < 1 || bits > 32 || tpk < 1 || (long long)bits * tpk > 64) {
        PyErr_SetString(PyExc_ValueError, "unsupported key layout");
        return -1;
    }
    if ((uint64_t)n > (uint64_t)INT32_MAX + 1) {
        PyErr_SetString(PyExc_ValueError, "more entries than an int32 suffix array holds");
        return -1;
    }
    self->keys = (const uint64_t *)self->keys_view.buf;
    self->sa = (const int32_t *)self->sa_view.buf;
    self->n = n;
    self->start = start;
    self->end = end;
    self->bits = bits;
    self->tpk = tpk;
    int bb = bits < BUCKET_BITS ? bits : BUCKET_BITS;
    if (n) {
        Py_ssize_t buckets = (Py_ssize_t)1 << bb;
        self->bucket = PyMem_Calloc((size_t)buckets + 1, sizeof(uint32_t));
        if (self->bucket == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        int shift = bits * tpk - bb; /* keys occupy their low bits * tpk bits */
        const uint64_t *keys = self->keys;
        uint32_t *bucket = self->bucket;
        int bad = 0;
        /* Bucket starts by binary search (2**bb searches, not a pass over n keys) and without the GIL:
         * a freshly mapped 10M-token index would otherwise fault its pages in while every thread waits. */
        Py_BEGIN_ALLOW_THREADS
        bad = (keys[n - 1] >> shift) >= (uint64_t)buckets || keys[0] > keys[n - 1];
        bucket[buckets] = (uint32_t)n;
        for (Py_ssize_t d = 1; !bad && d < buckets; d++) {
            uint64_t first = (uint64_t)d << shift; /* smallest key of bucket d */
            Py_ssize_t lo = bucket[d - 1], hi = n;
            while (lo < hi) {
                Py_ssize_t mid = lo + (hi - lo) / 2;
                if (keys[mid] < first) lo = mid + 1; else hi = mid;
            }
            bucket[d] = (uint32_t)lo;
        }
        Py_END_ALLOW_THREADS
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "keys are not sorted keys of this layout");
            return -1;
        }
        self->bucket_bits = bb;
        if (index_block_mins(self) < 0) return -1;
    }
    self->ready = 1;
    return 0;
}

static PyObject *index_nbytes(IndexObject *self, void *closure) {
    Py_ssize_t b = 0;
    if (self->bucket) b += (((Py_ssize_t)1 << self->bucket_bits) + 1) * (Py_ssize_t)sizeof(uint32_t);
    for (int l = 0; l < self->levels; l++) b += self->nmins[l] * (Py_ssize_t)sizeof(int32_t);
    return PyLong_FromSsize_t(b);
}

static PyGetSetDef index_getset[] = {
    {"nbytes", (getter)index_nbytes, NULL, "memory held beyond the index's own arrays", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "store._kernels.Index",
    .tp_basicsize = sizeof(IndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Index(keys, sa, start, end, bits, tokens_per_key): a suffix index's arrays held "
                        "for native matching (keeps them alive). Beyond them it holds a table of at most "
                        "2**12 + 1 uint32 bucket offsets and the suffix array's block minima (1/63 of "
                        "its size; see nbytes)."),
    .tp_getset = index_getset,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)index_init,
    .tp_dealloc = (destructor)index_dealloc,
};

/* Index of the k-th (from 0) set bit of x, which has more than k. */
static inline int select_bit(uint64_t x, Py_ssize_t k) {
    if (x == ~(uint64_t)0) return (int)k;
    uint64_t c = x - ((x >> 1) & 0x5555555555555555ULL);
    c = (c & 0x3333333333333333ULL) + ((c >> 2) & 0x3333333333333333ULL);
    c = ((c + (c >> 4)) & 0x0f0f0f0f0f0f0f0fULL) * 0x0101010101010101ULL; /* byte i: bits in bytes 0..i */
    int byte = 0;
    while ((Py_ssize_t)((c >> (8 * byte)) & 0xff) <= k) byte++;
    if (byte) k -= (Py_ssize_t)((c >> (8 * (byte - 1))) & 0xff);
    x >>= 8 * byte;
    while (k--) x &= x - 1;
    return 8 * byte + __builtin_ctzll(x);
}

/* Which of the len entries s[0, len) are at most thr (the held occurrences, see above), in one pass:
 * bit j of live[w] for entry 64 w + j, cnt[w] its set bits. Returns the total. Variants for the
 * instruction sets at hand (chosen when the module loads, see ``simd``) give the same maps. */
typedef Py_ssize_t (*LiveMapFn)(const int32_t *s, Py_ssize_t len, int32_t thr, uint64_t *live, uint8_t *cnt);

/* Words from w on, one entry at a time. */
static Py_ssize_t live_map_words(const int32_t *s, Py_ssize_t len, int32_t thr, uint64_t *live, uint8_t *cnt,
                                 Py_ssize_t w) {
    Py_ssize_t total = 0;
    for (; 64 * w < len; w++) {
        Py_ssize_t m = len - 64 * w < 64 ? len - 64 * w : 64;
        const int32_t *p = s + 64 * w;
        uint64_t word = 0;
        int c = 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            uint64_t held = p[j] <= thr;
            word |= held << j;
            c += (int)held;
        }
        live[w] = word;
        cnt[w] = (uint8_t)c;
        total += c;
    }
    return total;
}

static Py_ssize_t live_map_scalar(const int32_t *s, Py_ssize_t len, int32_t thr, uint64_t *live, uint8_t *cnt) {
    return live_map_words(s, len, thr, live, cnt, 0);
}

#if defined(__SSE2__)
static Py_ssize_t live_map_sse2(const int32_t *s, Py_ssize_t len, int32_t thr, uint64_t *live, uint8_t *cnt) {
    Py_ssize_t total = 0, w = 0;
    const __m128i t = _mm_set1_epi32(thr);
    for (; 64 * (w + 1) <= len; w++) {
        const int32_t *p = s + 64 * w;
        uint64_t dead = 0;
        __m128i acc = _mm_setzero_si128();
        for (int q = 0; q < 16; q++) {
            __m128i d = _mm_cmpgt_epi32(_mm_loadu_si128((const __m128i *)(p + 4 * q)), t);
            acc = _mm_sub_epi32(acc, d);
            dead |= (uint64_t)(unsigned)_mm_movemask_ps(_mm_castsi128_ps(d)) << (4 * q);
        }
        acc = _mm_add_epi32(acc, _mm_shuffle_epi32(acc, 0x4e));
        acc = _mm_add_epi32(acc, _mm_shuffle_epi32(acc, 0xb1));
        int c = 64 - _mm_cvtsi128_si32(acc);
        live[w] = ~dead;
        cnt[w] = (uint8_t)c;
        total += c;
    }
    return total + live_map_words(s, len, thr, live, cnt, w);
}
#endif

#if HAVE_X86_TARGETS
__attribute__((target("avx2,popcnt"))) static Py_ssize_t live_map_avx2(const int32_t *s, Py_ssize_t len,
                                                                       int32_t thr, uint64_t *live,
                                                                       uint8_t *cnt) {
    Py_ssize_t total = 0, w = 0;
    const __m256i t = _mm256_set1_epi32(thr);
    for (; 64 * (w + 1) <= len; w++) {
        const int32_t *p = s + 64 * w;
        uint64_t dead = 0;
        for (int q = 0; q < 8; q++) {
            __m256i d = _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(p + 8 * q)), t);
            dead |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(d)) << (8 * q);
        }
        int c = 64 - __builtin_popcountll(dead);
        live[w] = ~dead;
        cnt[w] = (uint8_t)c;
        total += c;
    }
    return total + live_map_words(s, len, thr, live, cnt, w);
}
#endif

/* Bit j of the result: p[j] == t, for the 64 tokens p[0, 64). Variants per instruction set, as for live maps. */
typedef uint64_t (*EqMaskFn)(const int32_t *p, int32_t t);

static uint64_t eq_mask_scalar(const int32_t *p, int32_t t) {
    uint64_t mask = 0;
    for (int j = 0; j < 64; j++) mask |= (uint64_t)(p[j] == t) << j;
    return mask;
}

#if defined(__SSE2__)
static uint64_t eq_mask_sse2(const int32_t *p, int32_t t) {
    const __m128i v = _mm_set1_epi32(t);
    uint64_t mask = 0;
    for (int q = 0; q < 16; q++) {
        __m128i e = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(p + 4 * q)), v);
        mask |= (uint64_t)(unsigned)_mm_movemask_ps(_mm_castsi128_ps(e)) << (4 * q);
    }
    return mask;
}
#endif

#if HAVE_X86_TARGETS
__attribute__((target("avx2"))) static uint64_t eq_mask_avx2(const int32_t *p, int32_t t) {
    const __m256i v = _mm256_set1_epi32(t);
    uint64_t mask = 0;
    for (int q = 0; q < 8; q++) {
        __m256i e = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(p + 8 * q)), v);
        mask |= (uint64_t)(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(e)) << (8 * q);
    }
    return mask;
}
#endif

static const struct {
    const char *name;
    LiveMapFn fn;
    EqMaskFn eq;
} live_maps[] = {
#if HAVE_X86_TARGETS
    {"avx2", live_map_avx2, eq_mask_avx2},
#endif
#if defined(__SSE2__)
    {"sse2", live_map_sse2, eq_mask_sse2},
#endif
    {"scalar", live_map_scalar, eq_mask_scalar},
};

static int live_map_choice; /* index into live_maps, set when the module loads */

static inline Py_ssize_t live_map(const int32_t *s, Py_ssize_t len, int32_t thr, uint64_t *live, uint8_t *cnt) {
    return live_maps[live_map_choice].fn(s, len, thr, live, cnt);
}

static inline uint64_t eq_mask(const int32_t *p, int32_t t) { return live_maps[live_map_choice].eq(p, t); }

static int live_map_supported(int i) {
#if HAVE_X86_TARGETS
    if (live_maps[i].fn == live_map_avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
#endif
    (void)i;
    return 1;
}

/* Appends base + i for every i in [0, n) with a[i] == t, ascending, skipping positions below oldest.
 * Blocks of 64 tokens are compared by the chosen instruction set (eq_mask, see ``simd``). */
static int find_all(const int32_t *a, Py_ssize_t n, int32_t t, int64_t base, int64_t oldest, Vec *out) {
    Py_ssize_t i = 0;
    if (base < oldest) { /* positions ascend with i: only a prefix lies below oldest */
        int64_t skip = oldest - base;
        if (skip >= n) return 0;
        i = (Py_ssize_t)skip;
    }
    for (; i + 64 <= n; i += 64) {
        uint64_t mask = eq_mask(a + i, t);
        while (mask) {
            int k = __builtin_ctzll(mask);
            mask &= mask - 1;
            if (vec_push(out, base + i + k) < 0) return -1;
        }
    }
    for (; i < n; i++)
        if (a[i] == t && vec_push(out, base + i) < 0) return -1;
    return 0;
}


/* A search result of one source: match length, counts, and the occurrences of the longest match in the
 * reference's order: a list (ends), or lazily the suffix-array range [lo, hi), restricted to its entries
 * with sa <= thr when ``filtered`` (a live map of them is built only when the occurrences are needed,
 * see seg_ready). */
typedef struct {
    int64_t m;
    Py_ssize_t ncounts; /* entries of counts (m with the current reference) */
    int64_t *counts;    /* caller's storage for at least max(limit, 1) entries */
    int lazy;
    const IndexObject *ix;
    Py_ssize_t lo, hi, nlive; /* nlive: entries held, once known */
    int filtered, mapped;
    int32_t thr;
    uint64_t *live;     /* (words,) live map of [lo, hi) when filtered and mapped (see live_map) */
    uint8_t *cnt;       /* (words,) */
    Py_ssize_t mapcap;  /* words allocated (one block: live, then cnt) */
    Vec ends;
} Seg;

static inline Py_ssize_t seg_len(const Seg *s) { return s->lazy ? s->nlive : s->ends.n; }

static void seg_init(Seg *s, int64_t *counts) {
    memset(s, 0, sizeof(*s));
    s->counts = counts;
}

static void seg_free(Seg *s) {
    vec_free(&s->ends);
    PyMem_RawFree(s->live);
    s->live = NULL;
    s->cnt = NULL;
    s->mapcap = 0;
}

/* Room for a live map of ``words`` words. */
static int seg_map_reserve(Seg *s, Py_ssize_t words) {
    if (words <= s->mapcap) return 0;
    Py_ssize_t c = s->mapcap ? s->mapcap : 64;
    while (c < words) c *= 2;
    void *p = PyMem_RawRealloc(s->live, (size_t)c * (sizeof(uint64_t) + 1));
    if (p == NULL) return nomem();
    s->live = p;
    s->cnt = (uint8_t *)(s->live + c);
    s->mapcap = c;
    return 0;
}

/* Makes the segment's occurrences countable and samplable (seg_len, seg_sample): builds the live map of a
 * filtered range. */
static int seg_ready(Seg *s) {
    if (!s->lazy || !s->filtered || s->mapped) return 0;
    if (seg_map_reserve(s, (s->hi - s->lo + 63) / 64) < 0) return -1;
    s->nlive = live_map(s->ix->sa + s->lo, s->hi - s->lo, s->thr, s->live, s->cnt);
    s->mapped = 1;
    return 0;
}

/* Appends the segment's entries first, first + step, ... (positions) to out; seg_ready was called. */
static int seg_sample(const Seg *s, Py_ssize_t first, Py_ssize_t step, Vec *out) {
    Py_ssize_t len = seg_len(s);
    if (first >= len) return 0;
    Py_ssize_t cnt = (len - first + step - 1) / step;
    if (vec_reserve(out, out->n + cnt) < 0) return -1;
    int64_t *o = out->v + out->n;
    if (!s->lazy) {
        for (Py_ssize_t t = 0; t < cnt; t++) o[t] = s->ends.v[first + t * step];
    } else {
        const int32_t *sa = s->ix->sa;
        int64_t top = s->ix->end - 1;
        if (!s->filtered) {
            Py_ssize_t p0 = s->lo + first;
            for (Py_ssize_t t = 0; t < cnt; t++) {
                if (t + PREFETCH_AHEAD < cnt) __builtin_prefetch(sa + p0 + (t + PREFETCH_AHEAD) * step);
                o[t] = top - (int64_t)sa[p0 + t * step];
            }
        } else { /* the held entries of ranks first, first + step, ..., found on the live map */
            const uint64_t *live = s->live;
            const uint8_t *wc = s->cnt;
            Py_ssize_t w = 0, rank = 0, want = first;
            for (Py_ssize_t t = 0; t < cnt; t++, want += step) {
                while (rank + wc[w] <= want) rank += wc[w++];
                o[t] = s->lo + 64 * w + select_bit(live[w], want - rank); /* entries first, then the */
                __builtin_prefetch(sa + o[t]);                             /* (prefetched) reads */
            }
            for (Py_ssize_t t = 0; t < cnt; t++) o[t] = top - (int64_t)sa[o[t]];
        }
    }
    out->n += cnt;
    return 0;
}

/* scan_matches over positions [start, stop); ctx holds at least ``limit`` tokens when limit > 0. */
static int scan_core(const Ring *r, int64_t start, int64_t stop, const int64_t *ctx, Py_ssize_t clen,
                     int64_t limit, int64_t oldest, Seg *out, Vec *lens) {
    out->m = 0;
    out->ncounts = 0;
    out->lazy = 0;
    out->ends.n = 0;
    if (stop <= start || clen == 0 || limit <= 0) return 0;
    int64_t cap = r->cap, first = ctx[0];
    int64_t lo = floor_mod(start, cap), hi = floor_mod(stop - 1, cap) + 1;
    if (first >= INT32_MIN && first <= INT32_MAX) {
        int32_t t = (int32_t)first;
        if (lo < hi) {
            if (find_all(r->d + lo, hi - lo, t, start, oldest, &out->ends) < 0) return -1;
        } else {
            if (find_all(r->d + lo, cap - lo, t, start, oldest, &out->ends) < 0) return -1;
            if (find_all(r->d, hi, t, start + (cap - lo), oldest, &out->ends) < 0) return -1;
        }
    }
    if (out->ends.n == 0) return 0;
    out->counts[0] = out->ends.n;
    int64_t m = extend_core(r, &out->ends, ctx, 1, limit, oldest, out->counts + 1, lens);
    if (m < 0) return -1;
    out->m = m;
    out->ncounts = m;
    return 0;
}

/* Lower bounds of lows[i] and upper bounds of highs[i] in keys[lo, hi) (hi > lo), all searches in
 * lockstep so that their memory reads overlap. */
static void bounds_lockstep(const uint64_t *keys, Py_ssize_t lo, Py_ssize_t hi, const uint64_t *lows,
                            const uint64_t *highs, int n, Py_ssize_t *lb, Py_ssize_t *ub) {
    const uint64_t *bl[64], *bu[64];
    for (int i = 0; i < n; i++) bl[i] = bu[i] = keys + lo;
    Py_ssize_t len = hi - lo;
    while (len > 1) {
        Py_ssize_t half = len >> 1;
        for (int i = 0; i < n; i++) {
            bl[i] = bl[i][half] < lows[i] ? bl[i] + half : bl[i];
            bu[i] = bu[i][half] <= highs[i] ? bu[i] + half : bu[i];
        }
        len -= half;
    }
    for (int i = 0; i < n; i++) {
        lb[i] = (bl[i] - keys) + (*bl[i] < lows[i]);
        ub[i] = (bu[i] - keys) + (*bu[i] <= highs[i]);
    }
}

/* The first entry i in [lo, hi) whose reversed suffix holds at least ``t`` at offset j, where every entry of the
 * range holds the same j tokens before it (so the suffix array orders them by that one): a binary search that reads
 * the ring buffer, which holds every indexed position while the index is not stale. A suffix that ends before offset
 * j (the snapshot's first document) or holds a separator there sorts before every token. */
static Py_ssize_t column_bound(const IndexObject *ix, const Ring *r, Py_ssize_t lo, Py_ssize_t hi, int64_t j,
                               int64_t t) {
    int64_t top = ix->end - 1 - j;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        int64_t pos = top - ix->sa[mid];
        int64_t v = pos < ix->start ? -1 : r->d[ring_slot(r, pos)];
        if (v < t) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* SuffixIndex.match. ctx holds clen >= 1 tokens, all in [0, INT32_MAX]; max_match, max_candidates >= 1.
 * The occurrences may stay a lazy suffix-array range (see Seg). */
static int index_core(IndexObject *ix, const int64_t *ctx, Py_ssize_t clen, int64_t max_match, const Ring *r,
                      int64_t oldest, int64_t max_candidates, Seg *out, Vec *lens) {
    out->m = 0;
    out->ncounts = 0;
    out->lazy = 0;
    out->ends.n = 0;
    if (ix->n == 0 || clen == 0) return 0;
    int64_t limit = max_match < clen ? max_match : clen;
    int64_t k = ix->tpk < limit ? ix->tpk : limit;
    int64_t unseen = ((int64_t)1 << ix->bits) - 1; /* token + 1 must stay below 1 << bits */
    for (int64_t i = 0; i < k; i++)
        if (ctx[i] >= unseen) {
            k = i;
            break;
        }
    if (k == 0) return 0;
    /* keys of suffixes beginning with the first i + 1 tokens lie in [lows[i], highs[i]]; the ranges nest */
    uint64_t lows[64], highs[64], value = 0;
    for (int64_t i = 0; i < k; i++) {
        value = (value << ix->bits) | (uint64_t)(ctx[i] + 1);
        int shift = ix->bits * (int)(ix->tpk - i - 1);
        lows[i] = value << shift;
        highs[i] = ((value + 1) << shift) - 1;
    }
    Py_ssize_t los[64], his[64];
    int64_t m = 0;
    if (ix->bucket_bits == ix->bits) { /* the table holds the first token's range */
        los[0] = ix->bucket[ctx[0] + 1];
        his[0] = ix->bucket[ctx[0] + 2];
        if (his[0] == los[0]) return 0;
        out->counts[0] = his[0] - los[0];
        m = 1;
    } else { /* every range lies inside the first token's bucket */
        uint64_t d = (uint64_t)(ctx[0] + 1) >> (ix->bits - ix->bucket_bits);
        los[0] = ix->bucket[d];
        his[0] = ix->bucket[d + 1];
        if (his[0] == los[0]) return 0;
    }
    if (k > m) /* bounds over all keys equal those inside a range that holds them */
        bounds_lockstep(ix->keys, los[0], his[0], lows + m, highs + m, (int)(k - m), los + m, his + m);
    for (; m < k && his[m] > los[m]; m++) out->counts[m] = his[m] - los[m];
    if (m == 0) return 0;
    int64_t top = ix->end - 1;
    const int32_t *sa = ix->sa;
    int stale = oldest > ix->start;
    if (m == k && limit > k) {
        Py_ssize_t lo = los[m - 1], hi = his[m - 1];
        if (!stale) { /* narrowed exactly, whatever the range's size, then extended one by one (or left lazy) */
            for (; m < limit && hi - lo > max_candidates; m++) {
                int64_t t = ctx[m];
                Py_ssize_t a = column_bound(ix, r, lo, hi, m, t), b = column_bound(ix, r, a, hi, m, t + 1);
                if (a == b) break;
                lo = a;
                hi = b;
                out->counts[m] = b - a;
            }
            if (hi - lo > max_candidates || m == limit) {
                out->m = out->ncounts = m;
                out->lazy = 1;
                out->ix = ix;
                out->lo = lo;
                out->hi = hi;
                out->filtered = 0;
                out->mapped = 0;
                out->thr = INT32_MAX;
                out->nlive = hi - lo;
                return 0;
            }
        }
        Py_ssize_t size = hi - lo, step = 1;
        if (size > max_candidates) step = (Py_ssize_t)((size + max_candidates - 1) / max_candidates);
        Py_ssize_t cnt = (size + step - 1) / step;
        if (vec_reserve(&out->ends, cnt) < 0) return -1;
        for (Py_ssize_t t = 0; t < cnt; t++) {
            if (t + PREFETCH_AHEAD < cnt) __builtin_prefetch(sa + lo + (t + PREFETCH_AHEAD) * step);
            out->ends.v[t] = top - (int64_t)sa[lo + t * step];
        }
        out->ends.n = cnt;
        int64_t longer = extend_core(r, &out->ends, ctx, m, limit, oldest, out->counts + m, lens);
        if (longer < 0) return -1;
        if (longer) {
            out->m = out->ncounts = longer;
            return 0;
        }
    }
    /* Every key-level occurrence of held tokens lies inside the snapshot, so it ends at or after
     * start + held - 1 (sa <= n - held); once the ring has overwritten positions below oldest > start,
     * those ending below oldest + held - 1 (sa > thr) are (partly) gone, and the longest match still
     * held may be shorter. */
    for (int64_t held = m; held > 0; held--) {
        Py_ssize_t a = los[held - 1], b = his[held - 1];
        int64_t over = oldest + (held - 1) - ix->start; /* occurrences ending at start + [0, over) drop */
        if (stale && over >= ix->n) continue;           /* nothing of the index is held */
        int32_t thr = stale ? (int32_t)(ix->n - 1 - over) : INT32_MAX;
        if (stale) { /* is any occurrence held? (the map, a pass over the range, waits until needed) */
            Py_ssize_t p = a;
            while (p < b && sa[p] > thr) p++;
            if (p == b) continue;
        }
        out->m = out->ncounts = held;
        out->lazy = 1;
        out->ix = ix;
        out->lo = a;
        out->hi = b;
        out->filtered = stale;
        out->mapped = 0;
        out->thr = thr;
        out->nlive = b - a; /* exact once mapped when filtered */
        return 0;
    }
    return 0;
}

/* continuations: rows (k, depth) of the tokens after each start, -1 after a separator or from stop. */
static void prefetch_rows(const Ring *r, const int64_t *starts, Py_ssize_t k) {
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t slot = ring_slot(r, starts[i]);
        __builtin_prefetch(r->d + slot);
        if (slot + 16 < r->cap) __builtin_prefetch(r->d + slot + 16);
    }
}

static void fill_rows(const Ring *r, const int64_t *starts, Py_ssize_t k, int64_t depth, int64_t stop,
                      int32_t *rows) {
    for (Py_ssize_t i = 0; i < k; i++) {
        int32_t *row = rows + i * depth;
        int64_t pos = starts[i];
        int64_t d = 0;
        if (depth > 0 && pos < stop) {
            int64_t slot = ring_slot(r, pos);
            for (; d < depth && pos < stop; d++, pos++) {
                int32_t v = r->d[slot];
                if (v < 0) break;
                row[d] = v;
                if (++slot == r->cap) slot = 0;
            }
        }
        for (; d < depth; d++) row[d] = -1;
    }
}

/* ---- Python entry points -------------------------------------------------------------------------- */

/* Copies a 1-D integer buffer's first n entries, reversed when ``reverse`` (ctx[j] = a[n - 1 - j]).
 * Returns 0 when a value falls outside [lo, hi]. */
static int copy_ints(const IntArg *a, Py_ssize_t from, Py_ssize_t n, int reverse, int64_t lo, int64_t hi,
                     int64_t *dst) {
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t v = int_at(a, reverse ? from + n - 1 - j : from + j);
        if (v < lo || v > hi) return 0;
        dst[j] = v;
    }
    return 1;
}

static PyObject *match_triple(int64_t m, const int64_t *counts, Py_ssize_t ncounts, Seg *s) {
    Vec ends = {0};
    if (seg_ready(s) < 0 || seg_sample(s, 0, 1, &ends) < 0) { /* before any call back into Python */
        vec_free(&ends);
        return NULL;
    }
    PyObject *out = NULL, *c = i64_array(counts, ncounts), *e = c ? i64_array(ends.v, ends.n) : NULL;
    if (e != NULL) out = Py_BuildValue("(LNN)", (long long)m, c, e);
    else Py_XDECREF(c);
    vec_free(&ends);
    return out;
}

PyDoc_STRVAR(scan_matches_doc,
"scan_matches(ring_data, start, stop, context_rev, limit, oldest) -> (m, counts, ends) | NotImplemented\n\n"
"Native store.match_kernels.scan_matches.");

static PyObject *py_scan_matches(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) return not_implemented();
    int64_t start, stop, limit, oldest;
    if (!get_i64(args[1], &start) || !get_i64(args[2], &stop) || !get_i64(args[4], &limit) ||
        !get_i64(args[5], &oldest))
        return not_implemented();
    IntArg ring = {0}, ctx = {0};
    PyObject *res = NULL;
    Vec lens = {0};
    int64_t stack_ctx[STACK_TOKENS], stack_counts[STACK_TOKENS], *cv = stack_ctx, *counts = stack_counts;
    Seg s;
    seg_init(&s, NULL);
    if (!ring_arg(args[0], &ring) || !int_arg(args[3], &ctx)) {
        res = not_implemented();
        goto done;
    }
    if (stop <= start || ctx.n == 0 || limit <= 0) {
        res = match_triple(0, NULL, 0, &s);
        goto done;
    }
    if (ctx.n < limit) {
        res = not_implemented();
        goto done;
    }
    if (limit > STACK_TOKENS) {
        cv = PyMem_Malloc((size_t)limit * sizeof(int64_t));
        counts = PyMem_Malloc((size_t)limit * sizeof(int64_t));
        if (cv == NULL || counts == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    copy_ints(&ctx, 0, (Py_ssize_t)limit, 0, INT64_MIN, INT64_MAX, cv);
    if (cv[0] < INT32_MIN || cv[0] > INT32_MAX) {
        res = not_implemented();
        goto done;
    }
    s.counts = counts;
    Ring r = {(const int32_t *)ring.view.buf, ring.n, 0};
    ring_set_base(&r, oldest);
    if (scan_core(&r, start, stop, cv, ctx.n, limit, oldest, &s, &lens) < 0) goto done;
    res = match_triple(s.m, counts, s.ncounts, &s);
done:
    int_release(&ring);
    int_release(&ctx);
    vec_free(&lens);
    seg_free(&s);
    if (cv != stack_ctx) PyMem_Free(cv);
    if (counts != stack_counts) PyMem_Free(counts);
    return res;
}

PyDoc_STRVAR(extend_matches_doc,
"extend_matches(ring_data, ends, context_rev, matched, limit, oldest) -> (m, counts, ends) | NotImplemented\n\n"
"Native store.match_kernels.extend_matches.");

static PyObject *py_extend_matches(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) return not_implemented();
    int64_t matched, limit, oldest;
    if (!get_i64(args[3], &matched) || !get_i64(args[4], &limit) || !get_i64(args[5], &oldest))
        return not_implemented();
    IntArg ring = {0}, ends = {0}, ctx = {0};
    PyObject *res = NULL;
    Vec lens = {0};
    int64_t *cv = NULL, *more = NULL;
    Seg s;
    seg_init(&s, NULL);
    if (!ring_arg(args[0], &ring) || !int_arg(args[1], &ends) || ends.kind != 8 || !int_arg(args[2], &ctx) ||
        matched < 0 || (limit > matched && ctx.n < limit)) {
        res = not_implemented();
        goto done;
    }
    Py_ssize_t span = limit > matched ? (Py_ssize_t)(limit - matched) : 0;
    cv = PyMem_Malloc((size_t)(limit > 0 ? limit : 1) * sizeof(int64_t));
    more = PyMem_Malloc((size_t)(span ? span : 1) * sizeof(int64_t));
    if (cv == NULL || more == NULL || vec_reserve(&s.ends, ends.n) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    if (limit > matched) copy_ints(&ctx, 0, (Py_ssize_t)limit, 0, INT64_MIN, INT64_MAX, cv);
    for (Py_ssize_t i = 0; i < ends.n; i++) s.ends.v[i] = int_at(&ends, i);
    s.ends.n = ends.n;
    Ring r = {(const int32_t *)ring.view.buf, ring.n, 0};
    ring_set_base(&r, oldest);
    int64_t m = extend_core(&r, &s.ends, cv, matched, limit, oldest, more, &lens);
    if (m < 0) goto done;
    res = match_triple(m, more, m ? (Py_ssize_t)(m - matched) : 0, &s);
done:
    int_release(&ring);
    int_release(&ends);
    int_release(&ctx);
    vec_free(&lens);
    seg_free(&s);
    PyMem_Free(cv);
    PyMem_Free(more);
    return res;
}

PyDoc_STRVAR(continuations_doc,
"continuations(ring_data, starts, depth, stop) -> (k, depth) int32 array | NotImplemented\n\n"
"Native store.match_kernels.continuations.");

static PyObject *py_continuations(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return not_implemented();
    int64_t depth, stop;
    if (!get_i64(args[2], &depth) || !get_i64(args[3], &stop)) return not_implemented();
    IntArg ring = {0}, starts = {0};
    PyObject *res = NULL;
    Vec sv = {0};
    if (!ring_arg(args[0], &ring) || !int_arg(args[1], &starts) || starts.kind < 0 ||
        depth > (int64_t)1 << 30) {
        res = not_implemented();
        goto done;
    }
    if (depth < 0) depth = 0;
    if (vec_reserve(&sv, starts.n) < 0) goto done;
    int64_t lowest = INT64_MAX;
    for (Py_ssize_t i = 0; i < starts.n; i++) {
        sv.v[i] = int_at(&starts, i);
        if (sv.v[i] < lowest) lowest = sv.v[i];
    }
    Ring r = {(const int32_t *)ring.view.buf, ring.n, 0};
    ring_set_base(&r, starts.n ? lowest : 0);
    int32_t *rows;
    prefetch_rows(&r, sv.v, starts.n);
    res = new_array(dtype_i32, starts.n, (Py_ssize_t)depth, 2, (void **)&rows);
    if (res != NULL) fill_rows(&r, sv.v, starts.n, depth, stop, rows);
done:
    int_release(&ring);
    int_release(&starts);
    vec_free(&sv);
    return res;
}

static int index_arg(PyObject *o, IndexObject **out) {
    if (o == Py_None) {
        *out = NULL;
        return 1;
    }
    if (!PyObject_TypeCheck(o, &IndexType) || !((IndexObject *)o)->ready) return 0;
    *out = (IndexObject *)o;
    return 1;
}

PyDoc_STRVAR(index_match_doc,
"index_match(index, context_rev, ring_data, oldest, max_match, max_candidates) -> (m, counts, ends) | "
"NotImplemented\n\nNative store.suffix_index.SuffixIndex.match.");

static PyObject *py_index_match(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) return not_implemented();
    IndexObject *ix;
    int64_t oldest, max_match, max_candidates;
    if (!index_arg(args[0], &ix) || ix == NULL || !get_i64(args[3], &oldest) || !get_i64(args[4], &max_match) ||
        !get_i64(args[5], &max_candidates))
        return not_implemented();
    IntArg ring = {0}, ctx = {0};
    PyObject *res = NULL;
    Vec lens = {0};
    int64_t *cv = NULL, *counts = NULL;
    Seg s;
    seg_init(&s, NULL);
    if (!ring_arg(args[2], &ring) || !int_arg(args[1], &ctx)) {
        res = not_implemented();
        goto done;
    }
    if (ix->n == 0 || ctx.n == 0) {
        res = match_triple(0, NULL, 0, &s);
        goto done;
    }
    if (max_match < 1 || max_candidates < 1) {
        res = not_implemented();
        goto done;
    }
    Py_ssize_t limit = (Py_ssize_t)(max_match < ctx.n ? max_match : ctx.n);
    cv = PyMem_Malloc((size_t)limit * sizeof(int64_t));
    counts = PyMem_Malloc((size_t)limit * sizeof(int64_t));
    if (cv == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!copy_ints(&ctx, 0, limit, 0, 0, INT32_MAX, cv)) {
        res = not_implemented();
        goto done;
    }
    s.counts = counts;
    Ring r = {(const int32_t *)ring.view.buf, ring.n, 0};
    ring_set_base(&r, oldest);
    if (index_core(ix, cv, limit, max_match, &r, oldest, max_candidates, &s, &lens) < 0) goto done;
    res = match_triple(s.m, counts, s.ncounts, &s);
done:
    int_release(&ring);
    int_release(&ctx);
    vec_free(&lens);
    seg_free(&s);
    PyMem_Free(cv);
    PyMem_Free(counts);
    return res;
}

/* Value of a piece of a suffix-array range: (index << 2) | level, an entry at level 0, a block minimum above. */
static inline int32_t piece_value(const IndexObject *ix, int64_t piece) {
    int level = (int)(piece & 3);
    Py_ssize_t i = (Py_ssize_t)(piece >> 2);
    return level ? ix->mins[level - 1][i] : ix->sa[i];
}

/* Keeps in p[0, n) the ``keep`` pieces of smallest value (all when n <= keep; values are distinct, each an
 * entry of the suffix array); returns how many are kept. */
static Py_ssize_t keep_smallest(const IndexObject *ix, int64_t *p, Py_ssize_t n, int64_t keep, int32_t *heap) {
    if (n <= keep) return n;
    Py_ssize_t h = 0; /* max-heap of the keep smallest values seen */
    for (Py_ssize_t g = 0; g < n; g++) {
        int32_t v = piece_value(ix, p[g]);
        if (h < keep) {
            Py_ssize_t i = h++;
            while (i > 0 && heap[(i - 1) / 2] < v) {
                heap[i] = heap[(i - 1) / 2];
                i = (i - 1) / 2;
            }
            heap[i] = v;
        } else if (v < heap[0]) {
            Py_ssize_t i = 0;
            for (;;) {
                Py_ssize_t c = 2 * i + 1;
                if (c >= h) break;
                if (c + 1 < h && heap[c + 1] > heap[c]) c++;
                if (heap[c] <= v) break;
                heap[i] = heap[c];
                i = c;
            }
            heap[i] = v;
        }
    }
    Py_ssize_t w = 0;
    for (Py_ssize_t g = 0; g < n; g++)
        if (piece_value(ix, p[g]) <= heap[0]) p[w++] = p[g];
    return w;
}

/* Appends to out the positions of the ``keep`` most recent occurrences (the smallest sa) of the suffix-array range
 * [lo, hi) that are held (sa <= thr), exactly as a pass over the whole range would find them, reading only the
 * block minima that cover it and the blocks that can hold them: the range is cut into whole blocks of each level,
 * the ``keep`` pieces of smallest minimum are kept (no other can hold one of the ``keep`` smallest entries) and
 * opened into the level below, down to the entries. -1 on error. */
static int range_most_recent(const IndexObject *ix, Py_ssize_t lo, Py_ssize_t hi, int32_t thr, int64_t keep,
                             Vec *out, Vec *work) {
    Py_ssize_t a = lo, b = hi;
    int level = 0;
    work->n = 0;
    while (a < b) {
        Py_ssize_t na = (a + MIN_BLOCK - 1) / MIN_BLOCK * MIN_BLOCK, nb = b / MIN_BLOCK * MIN_BLOCK;
        int last = level == ix->levels || na >= nb;
        Py_ssize_t cut_a = last ? b : na;
        if (vec_reserve(work, work->n + (cut_a - a) + (last ? 0 : b - nb)) < 0) return -1;
        for (Py_ssize_t i = a; i < cut_a; i++) work->v[work->n++] = ((int64_t)i << 2) | level;
        if (last) break;
        for (Py_ssize_t i = nb; i < b; i++) work->v[work->n++] = ((int64_t)i << 2) | level;
        a = na / MIN_BLOCK;
        b = nb / MIN_BLOCK;
        level++;
    }
    int32_t heap_stack[256];
    int32_t *heap = keep <= 256 ? heap_stack : PyMem_RawMalloc((size_t)keep * sizeof(int32_t));
    if (heap == NULL) return nomem();
    int rc = 0;
    for (;;) {
        Py_ssize_t n = keep_smallest(ix, work->v, work->n, keep, heap), opened = 0;
        work->n = n;
        for (Py_ssize_t g = 0; g < n; g++) opened += (work->v[g] & 3) ? MIN_BLOCK : 1;
        if (opened == n) break; /* entries only */
        if (vec_reserve(work, n + opened) < 0) {
            rc = -1;
            break;
        }
        int64_t *p = work->v;
        Py_ssize_t w = n;
        for (Py_ssize_t g = 0; g < n; g++) {
            int l = (int)(p[g] & 3);
            Py_ssize_t i = (Py_ssize_t)(p[g] >> 2);
            if (!l) {
                p[w++] = p[g];
                continue;
            }
            Py_ssize_t below = l > 1 ? ix->nmins[l - 2] : ix->n, c = i * MIN_BLOCK;
            Py_ssize_t e = c + MIN_BLOCK < below ? c + MIN_BLOCK : below;
            for (; c < e; c++) p[w++] = ((int64_t)c << 2) | (l - 1);
        }
        memmove(p, p + n, (size_t)(w - n) * sizeof(int64_t));
        work->n = w - n;
    }
    if (heap != heap_stack) PyMem_RawFree(heap);
    if (rc < 0) return -1;
    if (vec_reserve(out, out->n + work->n) < 0) return -1;
    int64_t top = ix->end - 1;
    for (Py_ssize_t g = 0; g < work->n; g++) {
        int32_t v = ix->sa[work->v[g] >> 2];
        if (v <= thr) out->v[out->n++] = top - (int64_t)v;
    }
    return 0;
}

/* Moves the ``k`` largest of v[0..n) (0 < k < n) to v[0..k), in no order: a quickselect,
 * linear whatever order they come in (a heap of the ``k`` largest sifts at nearly every value when they come
 * ascending, as the tail's occurrences and runs of an index's range do). */
static void select_largest(int64_t *v, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n - 1, t = k - 1;
    while (lo < hi) {
        int64_t a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        int64_t pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b)); /* median */
        Py_ssize_t i = lo, j = hi;
        while (i <= j) { /* descending: [lo, i) >= pivot >= (j, hi] */
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                int64_t x = v[i];
                v[i++] = v[j];
                v[j--] = x;
            }
        }
        if (t <= j) hi = j;
        else if (t >= i) lo = i;
        else break;
    }
}

static int descending(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

/* The most recent ``keep`` occurrences of the segments', newest first, into out (room for min(keep, total)
 * entries); -1 on error. A lazy range of more than ``max_examined`` entries is searched through its index's block
 * minima, the others are read whole: the same occurrences either way, whatever the split between the indexes. */
static int64_t pick_recent(const Seg *const *segs, int nsegs, int64_t max_examined, int64_t keep, int64_t *out,
                           Vec *sample, Vec *work) {
    sample->n = 0;
    for (int i = 0; i < nsegs; i++) {
        const Seg *s = segs[i];
        if (s->lazy && s->ix->levels && s->hi - s->lo > max_examined) {
            if (range_most_recent(s->ix, s->lo, s->hi, s->filtered ? s->thr : INT32_MAX, keep, sample, work) < 0)
                return -1;
        } else if (s->lazy && s->filtered && !s->mapped) { /* the held entries, read once (no live map) */
            if (vec_reserve(sample, sample->n + (s->hi - s->lo)) < 0) return -1;
            const int32_t *sa = s->ix->sa;
            int64_t top = s->ix->end - 1;
            for (Py_ssize_t i = s->lo; i < s->hi; i++)
                if (sa[i] <= s->thr) sample->v[sample->n++] = top - (int64_t)sa[i];
        } else if (seg_sample(s, 0, 1, sample) < 0) {
            return -1;
        }
    }
    int64_t *v = sample->v, n = sample->n < keep ? sample->n : keep;
    if (sample->n > keep) select_largest(v, sample->n, keep);
    memcpy(out, v, (size_t)n * sizeof(int64_t));
    qsort(out, (size_t)n, sizeof(int64_t), descending);
    return n;
}

/* ---- the tail's occurrence lists ------------------------------------------------------------------ */

/* Where each token, and each pair of tokens, occurs among the unindexed tokens after the suffix indexes (the
 * tail), kept up to date by the lookups themselves: instead of scanning the whole tail on every lookup, a lookup
 * first indexes what arrived since the last one. Positions [start, end) are covered: every position p there
 * holding token t >= 0 is in t's list, and in the list of the pair (token at p - 1, t) when p - 1 was still held
 * and held a token. Lists hold absolute positions, ascending. Searches give exactly what scanning gives. */
typedef struct {
    PyObject_HEAD
    int64_t start, end;   /* positions covered */
    int64_t window;       /* most unindexed tokens searched per lookup (the newest ones) */
    int64_t add_cost;     /* tokens scanned that cost as much as adding one to the lists (see tail_worth) */
    int64_t scanned;      /* tokens lookups scanned since the lists last answered */
    uint64_t *keys;       /* (slots,) open addressing: a token (< 2**31), or PAIR_BIT | first << 31 | second */
    int32_t *ids;         /* (slots,) list of each key, -1 for an empty slot */
    Py_ssize_t slots, used;
    Vec *lists;           /* (nlists,) occurrence lists; emptied lists keep their memory for reuse */
    Py_ssize_t nlists, listcap;
} TailObject;

#define PAIR_BIT ((uint64_t)1 << 63)
#define TAIL_SLACK 65536 /* stale positions tolerated before the lists drop them */
/* Most unindexed tokens a store lookup searches: the newest TAIL_WINDOW after the indexes (a Tail's ``window``
 * when one is given). What lies between the indexes' end and that window is not drafted from until a rebuild
 * indexes it, so a lookup never indexes or scans more than this many tokens however far indexing lags. */
#define TAIL_WINDOW 131072
/* Most tokens a lookup adds to a Tail's occurrence lists: a stretch that would need more (indexing lagging behind an
 * ingest, the lists out of date or starting over) is scanned instead. Lists kept up to date a little at a time
 * (lookups of many sessions while requests keep arriving) answer for the whole window. */
#define TAIL_LISTS 16384
/* A Tail's ``add_cost`` by default: adding a token to the lists costs about as much as scanning this many (36 ns
 * against 0.3 ns a token measured on a 2-core AMD EPYC, with the AVX2 scan; a lower figure favours the lists). */
#define TAIL_ADD_COST 64

static inline uint64_t tail_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

/* The list of ``key`` (NULL when it has none). */
static const Vec *tail_find(const TailObject *T, uint64_t key) {
    if (T->slots == 0) return NULL;
    Py_ssize_t mask = T->slots - 1, i = (Py_ssize_t)(tail_hash(key) & (uint64_t)mask);
    while (T->ids[i] >= 0) {
        if (T->keys[i] == key) return &T->lists[T->ids[i]];
        i = (i + 1) & mask;
    }
    return NULL;
}

static int tail_grow(TailObject *T) {
    Py_ssize_t slots = T->slots ? 2 * T->slots : 4096;
    uint64_t *keys = PyMem_Malloc((size_t)slots * sizeof(uint64_t));
    int32_t *ids = PyMem_Malloc((size_t)slots * sizeof(int32_t));
    if (keys == NULL || ids == NULL) {
        PyMem_Free(keys);
        PyMem_Free(ids);
        PyErr_NoMemory();
        return -1;
    }
    memset(ids, 0xff, (size_t)slots * sizeof(int32_t));
    for (Py_ssize_t j = 0; j < T->slots; j++) {
        if (T->ids[j] < 0) continue;
        Py_ssize_t i = (Py_ssize_t)(tail_hash(T->keys[j]) & (uint64_t)(slots - 1));
        while (ids[i] >= 0) i = (i + 1) & (slots - 1);
        keys[i] = T->keys[j];
        ids[i] = T->ids[j];
    }
    PyMem_Free(T->keys);
    PyMem_Free(T->ids);
    T->keys = keys;
    T->ids = ids;
    T->slots = slots;
    return 0;
}

/* Appends ``pos`` to the list of ``key``. */
static int tail_add(TailObject *T, uint64_t key, int64_t pos) {
    if (2 * (T->used + 1) > T->slots && tail_grow(T) < 0) return -1;
    Py_ssize_t mask = T->slots - 1, i = (Py_ssize_t)(tail_hash(key) & (uint64_t)mask);
    while (T->ids[i] >= 0 && T->keys[i] != key) i = (i + 1) & mask;
    if (T->ids[i] < 0) {
        if (T->nlists == T->listcap) {
            Py_ssize_t cap = T->listcap ? 2 * T->listcap : 1024;
            Vec *lists = PyMem_Realloc(T->lists, (size_t)cap * sizeof(Vec));
            if (lists == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memset(lists + T->listcap, 0, (size_t)(cap - T->listcap) * sizeof(Vec));
            T->lists = lists;
            T->listcap = cap;
        }
        T->keys[i] = key;
        T->ids[i] = (int32_t)T->nlists++;
        T->lists[T->ids[i]].n = 0;
        T->used++;
    }
    return vec_push(&T->lists[T->ids[i]], pos);
}

/* First index of list entries >= x. */
static Py_ssize_t lower_bound(const Vec *v, int64_t x) {
    Py_ssize_t lo = 0, hi = v->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (v->v[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Empties the lists (keeping their memory) to cover positions from ``from`` on. */
static void tail_rebase(TailObject *T, int64_t from) {
    if (T->slots) memset(T->ids, 0xff, (size_t)T->slots * sizeof(int32_t));
    T->used = 0;
    T->nlists = 0;
    T->start = T->end = from;
}

/* Drops the positions before ``from`` (start <= from <= end) from every list, and the keys left without any
 * (their lists' memory is kept for reuse): what starting over from ``from`` would hold, without indexing every
 * token again. */
static int tail_compact(TailObject *T, int64_t from) {
    uint64_t *key_of = PyMem_Malloc((size_t)(T->nlists ? T->nlists : 1) * sizeof(uint64_t));
    if (key_of == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < T->slots; j++)
        if (T->ids[j] >= 0) key_of[T->ids[j]] = T->keys[j];
    if (T->slots) memset(T->ids, 0xff, (size_t)T->slots * sizeof(int32_t));
    Py_ssize_t kept = 0, mask = T->slots - 1;
    for (Py_ssize_t id = 0; id < T->nlists; id++) {
        Vec *v = &T->lists[id];
        Py_ssize_t a = lower_bound(v, from);
        if (a == v->n) {
            v->n = 0;
            continue;
        }
        if (a) memmove(v->v, v->v + a, (size_t)(v->n - a) * sizeof(int64_t));
        v->n -= a;
        if (kept != id) { /* lists [kept, id) are emptied ones: swap this one down, in order */
            Vec emptied = T->lists[kept];
            T->lists[kept] = *v;
            T->lists[id] = emptied;
        }
        Py_ssize_t i = (Py_ssize_t)(tail_hash(key_of[id]) & (uint64_t)mask);
        while (T->ids[i] >= 0) i = (i + 1) & mask;
        T->keys[i] = key_of[id];
        T->ids[i] = (int32_t)kept++;
    }
    T->used = T->nlists = kept;
    T->start = from;
    PyMem_Free(key_of);
    return 0;
}

/* Whether the lists can cover positions from ``from`` on only by starting over: a gap before or after them, or all
 * of them overwritten. */
static int tail_gap(const TailObject *T, int64_t oldest, int64_t from) {
    return from < T->start || T->end < from || T->end < oldest;
}

/* Whether ``lookups`` lookups over [from, stop) should bring the lists up to date (tail_sync) and search them, rather
 * than scan: when what it adds (all of [from, stop) when it must start over, else what arrived since the last sync)
 * is at most ``cap`` tokens and costs no more than the scans since the lists last answered and these together.
 * Lookups that come often (many sessions a step) keep the lists up to date after a scan or two; rare ones while an
 * ingest pours tokens in keep scanning, which is cheaper for them. */
static int tail_worth(TailObject *T, int64_t oldest, int64_t from, int64_t stop, int64_t cap, int64_t lookups) {
    int64_t add = tail_gap(T, oldest, from) ? stop - from : stop - T->end, scan = (stop - from) * lookups;
    if (add <= cap && add * T->add_cost <= T->scanned + scan) {
        T->scanned = 0;
        return 1;
    }
    T->scanned += scan;
    return 0;
}

/* Covers [from, stop) of the ring (from >= oldest): indexes what arrived since the last call after dropping the
 * positions before ``from`` once they are most of the lists, or starts over from ``from`` when the lists have a
 * gap (see tail_worth for when it runs). */
static int tail_sync(TailObject *T, const Ring *r, int64_t oldest, int64_t from, int64_t stop) {
    if (tail_gap(T, oldest, from))
        tail_rebase(T, from);
    else if (from - T->start > T->end - from + TAIL_SLACK && tail_compact(T, from) < 0)
        return -1;
    for (int64_t p = T->end; p < stop; p++) {
        int32_t t = r->d[ring_slot(r, p)];
        if (t >= 0) {
            if (tail_add(T, (uint64_t)t, p) < 0) return -1;
            int32_t prev = p - 1 >= oldest ? r->d[ring_slot(r, p - 1)] : -1;
            if (prev >= 0 && tail_add(T, PAIR_BIT | (uint64_t)prev << 31 | (uint64_t)t, p) < 0) return -1;
        }
        T->end = p + 1;
    }
    return 0;
}

/* scan_core over [start, stop) answered from the lists (synced over that range, start >= oldest): the same
 * match length, counts and occurrences. */
static int tail_core(const TailObject *T, const Ring *r, int64_t start, int64_t stop, const int64_t *ctx,
                     Py_ssize_t clen, int64_t limit, int64_t oldest, Seg *out, Vec *lens) {
    out->m = 0;
    out->ncounts = 0;
    out->lazy = 0;
    out->ends.n = 0;
    if (stop <= start || clen == 0 || limit <= 0) return 0;
    const Vec *one = tail_find(T, (uint64_t)ctx[0]);
    if (one == NULL) return 0;
    Py_ssize_t a = lower_bound(one, start), b = lower_bound(one, stop);
    if (a == b) return 0;
    out->counts[0] = b - a;
    if (limit >= 2) { /* the occurrences matching two tokens or more are those of the pair */
        const Vec *two = tail_find(T, PAIR_BIT | (uint64_t)ctx[1] << 31 | (uint64_t)ctx[0]);
        Py_ssize_t c = two ? lower_bound(two, start > oldest ? start : oldest + 1) : 0, d = two ? lower_bound(two, stop) : 0;
        if (c < d) {
            if (vec_reserve(&out->ends, d - c) < 0) return -1;
            memcpy(out->ends.v, two->v + c, (size_t)(d - c) * sizeof(int64_t));
            out->ends.n = d - c;
            out->counts[1] = d - c;
            int64_t m = extend_core(r, &out->ends, ctx, 2, limit, oldest, out->counts + 2, lens);
            if (m < 0) return -1;
            out->m = out->ncounts = m;
            return 0;
        }
    }
    if (vec_reserve(&out->ends, b - a) < 0) return -1;
    memcpy(out->ends.v, one->v + a, (size_t)(b - a) * sizeof(int64_t));
    out->ends.n = b - a;
    out->m = out->ncounts = 1;
    return 0;
}

static void tail_dealloc(TailObject *T) {
    for (Py_ssize_t i = 0; i < T->listcap; i++) vec_free(&T->lists[i]);
    PyMem_Free(T->lists);
    PyMem_Free(T->keys);
    PyMem_Free(T->ids);
    Py_TYPE(T)->tp_free((PyObject *)T);
}

static PyObject *tail_nbytes(TailObject *T, void *closure) {
    Py_ssize_t n = T->slots * (Py_ssize_t)(sizeof(uint64_t) + sizeof(int32_t)) + T->listcap * (Py_ssize_t)sizeof(Vec);
    for (Py_ssize_t i = 0; i < T->listcap; i++) n += T->lists[i].cap * (Py_ssize_t)sizeof(int64_t);
    return PyLong_FromSsize_t(n);
}

static PyObject *tail_start(TailObject *T, void *closure) { return PyLong_FromLongLong(T->start); }
static PyObject *tail_end(TailObject *T, void *closure) { return PyLong_FromLongLong(T->end); }
static PyObject *tail_window(TailObject *T, void *closure) { return PyLong_FromLongLong(T->window); }
static PyObject *tail_add_cost(TailObject *T, void *closure) { return PyLong_FromLongLong(T->add_cost); }

static PyGetSetDef tail_getset[] = {
    {"nbytes", (getter)tail_nbytes, NULL, "Memory held by the lists.", NULL},
    {"start", (getter)tail_start, NULL, "First position covered.", NULL},
    {"end", (getter)tail_end, NULL, "One past the last position covered.", NULL},
    {"window", (getter)tail_window, NULL, "Most unindexed tokens (the newest) a lookup searches.", NULL},
    {"add_cost", (getter)tail_add_cost, NULL, "Tokens scanned that cost as much as adding one to the lists.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *tail_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"window", "add_cost", NULL};
    long long window = TAIL_WINDOW, add_cost = TAIL_ADD_COST;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|LL", names, &window, &add_cost)) return NULL;
    if (window < 1) {
        PyErr_SetString(PyExc_ValueError, "the tail window must be at least 1 token");
        return NULL;
    }
    if (add_cost < 0 || add_cost > ((long long)1 << 32)) {
        PyErr_SetString(PyExc_ValueError, "the tail's add_cost must be in [0, 2**32]");
        return NULL;
    }
    TailObject *T = (TailObject *)type->tp_alloc(type, 0);
    if (T != NULL) {
        T->window = (int64_t)window;
        T->add_cost = (int64_t)add_cost;
    }
    return (PyObject *)T;
}

static PyTypeObject TailType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "store._kernels.Tail",
    .tp_basicsize = sizeof(TailObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Tail(window=TAIL_WINDOW, add_cost=TAIL_ADD_COST): where each token and pair of tokens "
                        "occurs in a store's unindexed tail, kept up to date by the store lookups given it once they "
                        "would spend more scanning it than bringing the lists up to date, ``add_cost`` tokens "
                        "scanned a token added (same answers as scanning the tail); the lookups search only the "
                        "newest ``window`` unindexed tokens."),
    .tp_getset = tail_getset,
    .tp_new = tail_new,
    .tp_dealloc = (destructor)tail_dealloc,
};

/* 1: a Tail or None (*out NULL); 0: anything else. */
static int tail_arg(PyObject *o, TailObject **out) {
    *out = NULL;
    if (o == Py_None) return 1;
    if (!PyObject_TypeCheck(o, &TailType)) return 0;
    *out = (TailObject *)o;
    return 1;
}

/* ---- whole lookups, for Python and for other extensions -------------------------------------------- */

/* Working memory of lookups, kept between calls so that a run of lookups allocates nothing. */
struct Lookup {
    Vec lens, picked, sample, work;
    Seg segs[3];           /* tail, delta, main */
    int64_t *mem;          /* context (reversed; then the summed counts), then counts per source */
    Py_ssize_t memcap;
    int32_t *rows;
    Py_ssize_t rowscap;
};

static void lookup_clear(Lookup *L) {
    vec_free(&L->lens);
    vec_free(&L->picked);
    vec_free(&L->sample);
    vec_free(&L->work);
    for (int i = 0; i < 3; i++) seg_free(&L->segs[i]);
    PyMem_RawFree(L->mem);
    PyMem_RawFree(L->rows);
    memset(L, 0, sizeof(*L));
}

/* Room for ``n`` context or count entries in L->mem. */
static int lookup_mem(Lookup *L, Py_ssize_t n) {
    if (n <= L->memcap) return 0;
    Py_ssize_t c = L->memcap ? L->memcap : 4 * STACK_TOKENS;
    while (c < n) c *= 2;
    int64_t *p = PyMem_RawRealloc(L->mem, (size_t)c * sizeof(int64_t));
    if (p == NULL) return nomem();
    L->mem = p;
    L->memcap = c;
    return 0;
}

/* A segment emptied for the next search, keeping its memory. */
static void seg_reset(Seg *s, int64_t *counts) {
    s->m = 0;
    s->ncounts = 0;
    s->lazy = 0;
    s->mapped = 0;
    s->ends.n = 0;
    s->counts = counts;
}

/* Shared tail of the store and session lookups: rows of the chosen occurrences into L, the answer in *out. */
static int lookup_rows(Lookup *L, int64_t m, const int64_t *counts, const Ring *r, int64_t *ends, Py_ssize_t k,
                       int64_t depth, int64_t stop, LookupResult *out) {
    for (Py_ssize_t i = 0; i < k; i++) ends[i] += 1;
    if (depth > 0) prefetch_rows(r, ends, k);
    Py_ssize_t need = k * (Py_ssize_t)depth;
    if (need > L->rowscap) {
        Py_ssize_t c = L->rowscap ? L->rowscap : 1024;
        while (c < need) c *= 2;
        int32_t *p = PyMem_RawRealloc(L->rows, (size_t)c * sizeof(int32_t));
        if (p == NULL) return nomem();
        L->rows = p;
        L->rowscap = c;
    }
    fill_rows(r, ends, k, depth, stop, L->rows);
    *out = (LookupResult){m, counts, k, (Py_ssize_t)depth, L->rows};
    return 0;
}

/* The first unindexed position a store lookup searches: after the indexes, and at most the tail's window (or
 * TAIL_WINDOW) before ``stop`` (bounded work: only the newest unindexed tokens). */
static int64_t tail_from(const IndexObject *delta, const IndexObject *main_ix, const TailObject *tail, int64_t oldest,
                         int64_t stop) {
    int64_t idx_end = delta ? delta->end : (main_ix ? main_ix->end : 0), from = idx_end > oldest ? idx_end : oldest;
    int64_t window = tail ? tail->window : TAIL_WINDOW;
    return stop - from > window ? stop - window : from;
}

/* Whether the lists answer for [from, stop) as they are, with nothing to add or drop first. */
static int tail_covers(const TailObject *T, int64_t oldest, int64_t from, int64_t stop) {
    return !tail_gap(T, oldest, from) && T->end >= stop;
}

/* TokenStore.lookup for a context already reversed into L->mem (clen >= 1 tokens, all in [0, INT32_MAX]).
 * ``shared``: the tail's lists are only read (searched when they cover the unindexed tokens, else those are
 * scanned), so that lookups can run on several threads at once; else the lookup keeps them up to date as
 * tail_worth says. The same answer either way. Returns 0 (out->m == 0: nothing matched), 1 for arguments it does
 * not handle, -1 on error. */
static int store_core(Lookup *L, Py_ssize_t clen, const Ring *r, int64_t oldest, int64_t stop, IndexObject *delta,
                      IndexObject *main_ix, TailObject *tail, int64_t max_occ, int64_t depth, int64_t max_cand,
                      int64_t max_exam, int shared, LookupResult *out) {
    out->m = 0;
    int64_t *cv = L->mem;
    Seg *segs = L->segs;
    for (int i = 0; i < 3; i++) seg_reset(&segs[i], cv + (i + 1) * clen); /* tail, delta, main */
    int64_t from = tail_from(delta, main_ix, tail, oldest, stop);
    int lists = tail && from < stop &&
                (shared ? tail_covers(tail, oldest, from, stop) : tail_worth(tail, oldest, from, stop, TAIL_LISTS, 1));
    if (lists && !shared && tail_sync(tail, r, oldest, from, stop) < 0) return -1;
    if (lists ? tail_core(tail, r, from, stop, cv, clen, clen, oldest, &segs[0], &L->lens) < 0
              : scan_core(r, from, stop, cv, clen, clen, oldest, &segs[0], &L->lens) < 0)
        return -1;
    if (delta && index_core(delta, cv, clen, clen, r, oldest, max_cand, &segs[1], &L->lens) < 0) return -1;
    if (main_ix && index_core(main_ix, cv, clen, clen, r, oldest, max_cand, &segs[2], &L->lens) < 0) return -1;
    int64_t m = 0;
    for (int i = 0; i < 3; i++)
        if (segs[i].m > m) m = segs[i].m;
    if (m == 0) return 0;
    /* counts[:fm] += fc in the reference: shapes must agree or broadcast */
    for (int i = 0; i < 3; i++)
        if (segs[i].ncounts != segs[i].m && segs[i].ncounts != 1) return 1;
    int64_t *sum = cv; /* the context is no longer needed */
    memset(sum, 0, (size_t)m * sizeof(int64_t));
    const Seg *longest[3];
    int nl = 0;
    Py_ssize_t n_ends = 0;
    for (int i = 0; i < 3; i++) {
        if (segs[i].ncounts == segs[i].m)
            for (int64_t j = 0; j < segs[i].m; j++) sum[j] += segs[i].counts[j];
        if (segs[i].m == m) { /* a filtered range counts all its entries here: at least those held */
            longest[nl++] = &segs[i];
            n_ends += seg_len(&segs[i]);
        }
    }
    int64_t keep = max_occ < n_ends ? max_occ : n_ends;
    if (vec_reserve(&L->picked, keep ? keep : 1) < 0) return -1;
    int64_t k = pick_recent(longest, nl, max_exam, max_occ, L->picked.v, &L->sample, &L->work);
    if (k < 0) return -1;
    return lookup_rows(L, m, sum, r, L->picked.v, (Py_ssize_t)k, depth, stop, out);
}

/* DraftSession.lookup over tokens[:n] (n <= cap; n >= 2, max_match, max_occ >= 1, depth >= 0). Returns 0
 * (out->m == 0: nothing matched) or -1 on error. */
static int session_core(Lookup *L, const int32_t *t, Py_ssize_t cap, int64_t n, int64_t max_match, int64_t max_occ,
                        int64_t depth, LookupResult *out) {
    out->m = 0;
    Py_ssize_t clen = (Py_ssize_t)(max_match < n ? max_match : n);
    if (lookup_mem(L, 2 * clen) < 0) return -1;
    int64_t *cv = L->mem;
    for (Py_ssize_t j = 0; j < clen; j++) cv[j] = t[n - 1 - j];
    Seg *s = &L->segs[0];
    seg_reset(s, cv + clen);
    Ring r = {t, cap, 0};
    if (scan_core(&r, 0, n - 1, cv, clen, clen, 0, s, &L->lens) < 0) return -1;
    if (s->m == 0) return 0;
    /* the most recent max_occurrences, newest first */
    Py_ssize_t c = s->ends.n, k = c > max_occ ? (Py_ssize_t)max_occ : c;
    int64_t *e = s->ends.v + (c - k);
    for (Py_ssize_t i = 0; i < k / 2; i++) {
        int64_t x = e[i];
        e[i] = e[k - 1 - i];
        e[k - 1 - i] = x;
    }
    return lookup_rows(L, s->m, s->counts, &r, e, k, depth, n, out);
}

/* The Python entry points' working memory, reused between calls. Making the result arrays may run Python code
 * (a collection's finalizers) and so let another thread in: a call that finds it in use takes its own. */
static Lookup py_lookup;
static int py_lookup_busy;

static Lookup *lookup_acquire(Lookup *own) {
    if (py_lookup_busy) return own;
    py_lookup_busy = 1;
    return &py_lookup;
}

static void lookup_release(Lookup *L) {
    if (L == &py_lookup) py_lookup_busy = 0;
    else lookup_clear(L);
}

/* (m, counts, rows) arrays of an answer; None when nothing matched. */
static PyObject *lookup_tuple(const LookupResult *res) {
    if (res->m == 0) Py_RETURN_NONE;
    PyObject *c = i64_array(res->counts, (Py_ssize_t)res->m);
    if (c == NULL) return NULL;
    int32_t *rows;
    PyObject *rw = new_array(dtype_i32, res->k, res->depth, 2, (void **)&rows);
    if (rw == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    if (res->k > 0 && res->depth > 0) memcpy(rows, res->rows, (size_t)(res->k * res->depth) * sizeof(int32_t));
    return Py_BuildValue("(LNN)", (long long)res->m, c, rw);
}

PyDoc_STRVAR(store_lookup_doc,
"store_lookup(context, ring_data, oldest, stop, delta, main, max_match, max_occurrences, depth, "
"max_candidates, max_examined, tail=None) -> (m, counts, rows) | None | NotImplemented\n\n"
"Native TokenStore.lookup: None when nothing matched; delta and main are Index handles or None; tail, a Tail\n"
"(brought up to date first) that answers for the unindexed tokens instead of a scan. Only the newest unindexed\n"
"tokens are searched: the Tail's window of them, or TAIL_WINDOW without one.");

static PyObject *py_store_lookup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11 && nargs != 12) return not_implemented();
    IndexObject *delta, *main_ix;
    TailObject *tail = NULL;
    if (nargs == 12 && !tail_arg(args[11], &tail)) return not_implemented();
    int64_t oldest, stop, max_match, max_occ, depth, max_cand, max_exam;
    if (!get_i64(args[2], &oldest) || !get_i64(args[3], &stop) || !index_arg(args[4], &delta) ||
        !index_arg(args[5], &main_ix) || !get_i64(args[6], &max_match) || !get_i64(args[7], &max_occ) ||
        !get_i64(args[8], &depth) || !get_i64(args[9], &max_cand) || !get_i64(args[10], &max_exam))
        return not_implemented();
    if (max_match < 1 || max_occ < 1 || max_cand < 1 || max_exam < 1 || depth > (int64_t)1 << 30)
        return not_implemented();
    if (depth < 0) depth = 0;
    IntArg ring = {0}, ctx = {0};
    PyObject *res = NULL;
    Lookup own = {0}, *L = lookup_acquire(&own);
    if (!int_arg(args[0], &ctx) || !ring_arg(args[1], &ring)) {
        res = not_implemented();
        goto done;
    }
    Py_ssize_t clen = ctx.n > max_match ? (Py_ssize_t)max_match : ctx.n;
    if (clen == 0) {
        res = Py_NewRef(Py_None);
        goto done;
    }
    if (lookup_mem(L, 4 * clen) < 0) goto done;
    if (!copy_ints(&ctx, ctx.n - clen, clen, 1, 0, INT32_MAX, L->mem)) {
        res = not_implemented();
        goto done;
    }
    Ring r = {(const int32_t *)ring.view.buf, ring.n, 0};
    ring_set_base(&r, oldest);
    LookupResult found;
    int rc = store_core(L, clen, &r, oldest, stop, delta, main_ix, tail, max_occ, depth, max_cand, max_exam, 0, &found);
    if (rc >= 0) res = rc ? not_implemented() : lookup_tuple(&found);
done:
    int_release(&ring);
    int_release(&ctx);
    lookup_release(L);
    return res;
}

PyDoc_STRVAR(session_lookup_doc,
"session_lookup(tokens, n, max_match, max_occurrences, depth) -> (m, counts, rows) | None | NotImplemented\n\n"
"Native DraftSession.lookup over the session's tokens[:n]: None when nothing matched.");

static PyObject *py_session_lookup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) return not_implemented();
    int64_t n, max_match, max_occ, depth;
    if (!get_i64(args[1], &n) || !get_i64(args[2], &max_match) || !get_i64(args[3], &max_occ) ||
        !get_i64(args[4], &depth))
        return not_implemented();
    if (n < 2 || max_match < 1) Py_RETURN_NONE;
    if (max_occ < 1 || depth > (int64_t)1 << 30) return not_implemented();
    if (depth < 0) depth = 0;
    IntArg tok = {0};
    PyObject *res = NULL;
    Lookup own = {0}, *L = lookup_acquire(&own);
    if (!ring_arg(args[0], &tok) || n > tok.n) {
        res = not_implemented();
        goto done;
    }
    LookupResult found;
    if (session_core(L, (const int32_t *)tok.view.buf, tok.n, n, max_match, max_occ, depth, &found) == 0)
        res = lookup_tuple(&found);
done:
    int_release(&tok);
    lookup_release(L);
    return res;
}

static Lookup *capi_lookup_new(void) {
    Lookup *L = PyMem_RawCalloc(1, sizeof(Lookup));
    if (L == NULL) nomem();
    return L;
}

static void capi_lookup_free(Lookup *L) {
    if (L == NULL) return;
    lookup_clear(L);
    PyMem_RawFree(L);
}

static int store_lookup_as(int shared, Lookup *L, const int32_t *context, Py_ssize_t n, const int32_t *ring,
                           Py_ssize_t cap, int64_t oldest, int64_t stop, PyObject *delta_o, PyObject *main_o,
                           PyObject *tail_o, int64_t max_match, int64_t max_occ, int64_t depth, int64_t max_cand,
                           int64_t max_exam, LookupResult *out) {
    out->m = 0;
    IndexObject *delta, *main_ix;
    TailObject *tail;
    if (!index_arg(delta_o, &delta) || !index_arg(main_o, &main_ix) || !tail_arg(tail_o, &tail) || cap < 1) return 1;
    if (max_match < 1 || max_occ < 1 || max_cand < 1 || max_exam < 1 || depth > (int64_t)1 << 30) return 1;
    if (depth < 0) depth = 0;
    Py_ssize_t clen = n > max_match ? (Py_ssize_t)max_match : n;
    if (clen <= 0) return 0;
    if (lookup_mem(L, 4 * clen) < 0) return -1;
    for (Py_ssize_t j = 0; j < clen; j++) {
        int32_t v = context[n - 1 - j];
        if (v < 0) return 1;
        L->mem[j] = v;
    }
    Ring r = {ring, cap, 0};
    ring_set_base(&r, oldest);
    return store_core(L, clen, &r, oldest, stop, delta, main_ix, tail, max_occ, depth, max_cand, max_exam, shared,
                      out);
}

static int capi_store_lookup(Lookup *L, const int32_t *context, Py_ssize_t n, const int32_t *ring, Py_ssize_t cap,
                             int64_t oldest, int64_t stop, PyObject *delta_o, PyObject *main_o, PyObject *tail_o,
                             int64_t max_match, int64_t max_occ, int64_t depth, int64_t max_cand, int64_t max_exam,
                             LookupResult *out) {
    return store_lookup_as(0, L, context, n, ring, cap, oldest, stop, delta_o, main_o, tail_o, max_match, max_occ,
                           depth, max_cand, max_exam, out);
}

static int capi_store_lookup_shared(Lookup *L, const int32_t *context, Py_ssize_t n, const int32_t *ring,
                                    Py_ssize_t cap, int64_t oldest, int64_t stop, PyObject *delta_o, PyObject *main_o,
                                    PyObject *tail_o, int64_t max_match, int64_t max_occ, int64_t depth,
                                    int64_t max_cand, int64_t max_exam, LookupResult *out) {
    quiet = 1;
    int rc = store_lookup_as(1, L, context, n, ring, cap, oldest, stop, delta_o, main_o, tail_o, max_match, max_occ,
                             depth, max_cand, max_exam, out);
    quiet = 0;
    return rc;
}

static int capi_store_prepare(const int32_t *ring, Py_ssize_t cap, int64_t oldest, int64_t stop, PyObject *delta_o,
                              PyObject *main_o, PyObject *tail_o, Py_ssize_t lookups) {
    IndexObject *delta, *main_ix;
    TailObject *tail;
    if (!index_arg(delta_o, &delta) || !index_arg(main_o, &main_ix) || !tail_arg(tail_o, &tail) || cap < 1 || !tail)
        return 0;
    int64_t from = tail_from(delta, main_ix, tail, oldest, stop);
    if (from >= stop) return 0;
    Ring r = {ring, cap, 0};
    ring_set_base(&r, oldest);
    /* For the whole step's lookups at once, without the cap of TAIL_LISTS tokens a lone lookup keeps: the window
     * bounds what is added, and lists that fell further behind (a tail past TAIL_LISTS when the step first came,
     * indexing lagging behind a steady stream of requests) would otherwise never catch up, and every lookup of every
     * step would scan the window. */
    if (tail_worth(tail, oldest, from, stop, INT64_MAX, lookups)) return tail_sync(tail, &r, oldest, from, stop);
    return 0;
}

static int capi_session_lookup(Lookup *L, const int32_t *tokens, Py_ssize_t cap, int64_t n, int64_t max_match,
                               int64_t max_occ, int64_t depth, LookupResult *out) {
    out->m = 0;
    if (n < 2 || max_match < 1) return 0;
    if (max_occ < 1 || depth > (int64_t)1 << 30 || n > cap) return 1;
    return session_core(L, tokens, cap, n, max_match, max_occ, depth < 0 ? 0 : depth, out);
}

static int capi_session_lookup_shared(Lookup *L, const int32_t *tokens, Py_ssize_t cap, int64_t n, int64_t max_match,
                                      int64_t max_occ, int64_t depth, LookupResult *out) {
    quiet = 1;
    int rc = capi_session_lookup(L, tokens, cap, n, max_match, max_occ, depth, out);
    quiet = 0;
    return rc;
}

static KernelsCAPI kernels_capi = {sizeof(KernelsCAPI), capi_lookup_new, capi_lookup_free, capi_store_lookup,
                                   capi_session_lookup, capi_store_lookup_shared, capi_session_lookup_shared,
                                   capi_store_prepare};

PyDoc_STRVAR(simd_doc,
"simd(name=None) -> str\n\n"
"The instruction set that filters overwritten suffix-array entries and scans unindexed tokens\n"
"(\"avx2\", \"sse2\" or \"scalar\"; the fastest this CPU runs is chosen on import); with a name, switch to\n"
"it first (ValueError when this CPU or build lacks it). Every choice gives the same results.");

static PyObject *py_simd(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "simd() takes at most one argument");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        const char *name = PyUnicode_Check(args[0]) ? PyUnicode_AsUTF8(args[0]) : NULL;
        if (name == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "simd() takes a str");
            return NULL;
        }
        int found = -1;
        for (int i = 0; i < (int)(sizeof(live_maps) / sizeof(live_maps[0])); i++)
            if (strcmp(live_maps[i].name, name) == 0 && live_map_supported(i)) found = i;
        if (found < 0) {
            PyErr_Format(PyExc_ValueError, "instruction set %R is not available here", args[0]);
            return NULL;
        }
        live_map_choice = found;
    }
    return PyUnicode_FromString(live_maps[live_map_choice].name);
}

PyDoc_STRVAR(pack_keys_doc,
"pack_keys(rev, sa, bits, tokens_per_key) -> (n,) uint64 array | NotImplemented\n\n"
"Native store.suffix_index._pack_keys: the first tokens_per_key tokens of each reversed suffix sa[i], token + 1,\n"
"zero from a separator (or the end) on, packed big-endian in bits bits each. Runs without the interpreter lock.");

static PyObject *py_pack_keys(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return not_implemented();
    int64_t bits, per_key;
    if (!get_i64(args[2], &bits) || !get_i64(args[3], &per_key)) return not_implemented();
    IntArg rev = {0}, sa = {0};
    PyObject *res = NULL;
    if (!int_arg(args[0], &rev) || rev.kind != 4 || rev.stride != 4 || !int_arg(args[1], &sa) || sa.kind != 4 ||
        sa.stride != 4 || sa.n != rev.n || bits < 1 || bits > 32 || per_key < 1 || bits * per_key > 64) {
        res = not_implemented();
        goto done;
    }
    const int32_t *r = (const int32_t *)rev.view.buf, *order = (const int32_t *)sa.view.buf;
    const Py_ssize_t n = rev.n;
    uint64_t *keys;
    res = new_array(dtype_u64, n, 0, 1, (void **)&keys);
    if (res == NULL) goto done;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    enum { AHEAD = 16 }; /* suffixes prefetched ahead: each key is one scattered read (a prefetch never faults) */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(r + order[i + AHEAD]);
        Py_ssize_t p = order[i];
        if (p < 0 || p >= n) { /* not a suffix array of rev: never read out of bounds */
            bad = 1;
            break;
        }
        uint64_t key = 0;
        int alive = 1;
        for (int64_t j = 0; j < per_key; j++) {
            int64_t tok = alive && p + j < n ? (int64_t)r[p + j] : -1;
            alive = tok >= 0;
            key = (key << bits) | (uint64_t)(alive ? tok + 1 : 0);
        }
        keys[i] = key;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        Py_DECREF(res);
        res = not_implemented();
    }
done:
    int_release(&rev);
    int_release(&sa);
    return res;
}

static PyMethodDef kernel_methods[] = {
    {"pack_keys", (PyCFunction)(void (*)(void))py_pack_keys, METH_FASTCALL, pack_keys_doc},
    {"simd", (PyCFunction)(void (*)(void))py_simd, METH_FASTCALL, simd_doc},
    {"scan_matches", (PyCFunction)(void (*)(void))py_scan_matches, METH_FASTCALL, scan_matches_doc},
    {"extend_matches", (PyCFunction)(void (*)(void))py_extend_matches, METH_FASTCALL, extend_matches_doc},
    {"continuations", (PyCFunction)(void (*)(void))py_continuations, METH_FASTCALL, continuations_doc},
    {"index_match", (PyCFunction)(void (*)(void))py_index_match, METH_FASTCALL, index_match_doc},
    {"store_lookup", (PyCFunction)(void (*)(void))py_store_lookup, METH_FASTCALL, store_lookup_doc},
    {"session_lookup", (PyCFunction)(void (*)(void))py_session_lookup, METH_FASTCALL, session_lookup_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kernels_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "store._kernels",
    .m_doc = "Native kernels for the token store's lookups (same results as the numpy reference).",
    .m_size = -1,
    .m_methods = kernel_methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *np = PyImport_ImportModule("numpy");
    if (np == NULL) return NULL;
    np_empty = PyObject_GetAttrString(np, "empty");
    PyObject *dtype = PyObject_GetAttrString(np, "dtype");
    Py_DECREF(np);
    if (np_empty == NULL || dtype == NULL) {
        Py_XDECREF(dtype);
        return NULL;
    }
    dtype_i64 = PyObject_CallFunction(dtype, "s", "int64");
    dtype_i32 = PyObject_CallFunction(dtype, "s", "int32");
    dtype_u64 = PyObject_CallFunction(dtype, "s", "uint64");
    Py_DECREF(dtype);
    if (dtype_i64 == NULL || dtype_i32 == NULL || dtype_u64 == NULL) return NULL;
    if (PyType_Ready(&IndexType) < 0 || PyType_Ready(&TailType) < 0) return NULL;
#if HAVE_X86_TARGETS
    __builtin_cpu_init();
#endif
    live_map_choice = 0;
    while (!live_map_supported(live_map_choice)) live_map_choice++; /* the last one always is */
    PyObject *m = PyModule_Create(&kernels_module);
    if (m == NULL) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&TailType);
    if (PyModule_AddObject(m, "Tail", (PyObject *)&TailType) < 0) {
        Py_DECREF(&TailType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "TAIL_WINDOW", TAIL_WINDOW) < 0 ||
        PyModule_AddIntConstant(m, "TAIL_LISTS", TAIL_LISTS) < 0 ||
        PyModule_AddIntConstant(m, "TAIL_ADD_COST", TAIL_ADD_COST) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(&kernels_capi, "store._kernels._C_API", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
