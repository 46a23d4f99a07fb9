/* Native LRU n-gram table (Cacheback's dynamic table): store.ngram_table.PyLRUNGramTable in C.
 *
 * Leaders (LL tokens) live in a node array. An open-addressing hash table (linear probing, backward-shift
 * deletion, load at most 1/2) maps a leader's tokens to its node, and the nodes form a doubly linked list
 * from least to most recent. Each leader holds its followers in a growable array of records kept least
 * recent first; a record is FL int32 tokens followed by a 64-bit insertion count. Follower arrays start
 * small, double up to FC, and are freed with their leader, so memory is bounded by LC and FC. The node of
 * an evicted leader is reused by the leader that evicted it, so nodes stay dense (0 .. n-1).
 *
 * Token ids are non-negative int32. The GIL is held throughout. Every argument is converted to C before
 * the table changes, so a bad argument (wrong length, id outside [0, 2**31), wrong type) changes nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_lru_api.h"

#define MAX_LEN 8           /* longest leader and follower */
#define NIL UINT32_MAX      /* no node */
#define STACK_TOKENS 512    /* update() converts up to this many tokens without allocating */
#define FIRST_FOLLOWERS 4   /* records allocated for a new leader */
#define MIN_SLOTS 16

typedef struct {
    int32_t key[MAX_LEN];   /* the leader's tokens; entries past LL are zero */
    uint32_t prev, next;    /* recency list: toward least recent, toward most recent */
    uint32_t hash;
    uint32_t nfol;          /* followers held */
    uint32_t capfol;        /* records allocated */
    uint32_t lo;            /* records of the allocation before ``fol`` (see table_insert) */
    int32_t *fol;           /* nfol records of `stride` int32 words, least recent first, lo records into an
                             * allocation of capfol */
} Leader;                   /* 64 bytes: one cache line */

/* The start of a leader's follower allocation. */
static inline int32_t *fol_base(const Leader *L, int stride) { return L->fol ? L->fol - (size_t)L->lo * stride : NULL; }

typedef struct {
    Leader *nodes;          /* nodes[0 .. n-1] hold leaders */
    uint32_t n, nalloc;
    uint64_t *slots;        /* 0: empty; else hash << 32 | (node + 1) */
    size_t mask;            /* slots - 1 (slots is a power of two), 0 when no slot array */
    uint32_t head, tail;    /* least and most recent leader, NIL when empty */
    int64_t followers;      /* followers held over all leaders */
} Core;

typedef struct {
    PyObject_HEAD
    Py_ssize_t leader_len, follower_len, leader_capacity, follower_capacity;
    int ll, fl, stride;     /* stride: int32 words per follower record (FL tokens + 2 for the count) */
    Core c;
    uint64_t version;       /* bumped on every change, for iterators */
} LRUTable;

typedef struct {
    PyObject_HEAD
    LRUTable *table;        /* NULL once exhausted */
    uint32_t cur;
    uint64_t version;
} ItemsIter;

static PyTypeObject LRUTableType;
static PyTypeObject ItemsIterType;

/* ---- hashing and records -------------------------------------------------------------------------- */

static inline uint32_t hash_key(const int32_t *k, int n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (int i = 0; i < n; i++) {
        h = (h ^ (uint32_t)k[i]) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return (uint32_t)h;
}

static inline int tokens_equal(const int32_t *a, const int32_t *b, int n) {
    for (int i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

static inline int64_t rec_count(const int32_t *r, int fl) {
    int64_t v;
    memcpy(&v, r + fl, sizeof v);
    return v;
}

static inline void rec_write(int32_t *r, const int32_t *fol, int fl, int64_t count) {
    memcpy(r, fol, (size_t)fl * sizeof(int32_t));
    memcpy(r + fl, &count, sizeof count);
}

/* ---- core: hash table, recency list, nodes -------------------------------------------------------- */

static void core_free(Core *c, int stride) {
    for (uint32_t i = 0; i < c->n; i++) PyMem_Free(fol_base(&c->nodes[i], stride));
    PyMem_Free(c->nodes);
    PyMem_Free(c->slots);
    memset(c, 0, sizeof *c);
    c->head = c->tail = NIL;
}

static inline uint32_t core_find(const Core *c, const int32_t *key, uint32_t hash, int ll) {
    if (c->slots == NULL) return NIL;
    size_t i = hash & c->mask;
    for (;;) {
        uint64_t s = c->slots[i];
        if (s == 0) return NIL;
        if ((uint32_t)(s >> 32) == hash) {
            uint32_t idx = (uint32_t)s - 1;
            if (tokens_equal(c->nodes[idx].key, key, ll)) return idx;
        }
        i = (i + 1) & c->mask;
    }
}

static inline void slot_put(uint64_t *slots, size_t mask, uint32_t hash, uint32_t idx) {
    size_t i = hash & mask;
    while (slots[i]) i = (i + 1) & mask;
    slots[i] = ((uint64_t)hash << 32) | ((uint64_t)idx + 1);
}

/* Remove the slot of node idx, shifting later entries of its probe run back (no tombstones). */
static void slot_remove(Core *c, uint32_t hash, uint32_t idx) {
    const size_t mask = c->mask;
    const uint64_t want = ((uint64_t)hash << 32) | ((uint64_t)idx + 1);
    size_t i = hash & mask;
    while (c->slots[i] != want) i = (i + 1) & mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t s = c->slots[j];
        if (s == 0) break;
        size_t home = (uint32_t)(s >> 32) & mask;
        /* the entry at j may move to the hole at i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            c->slots[i] = s;
            i = j;
        }
    }
    c->slots[i] = 0;
}

/* Room for one more node and its slot; -1 with MemoryError and nothing changed. */
static int core_reserve(Core *c) {
    if (c->n == c->nalloc) {
        if (c->nalloc >= NIL / 2) {
            PyErr_SetString(PyExc_MemoryError, "LRUTable cannot hold more leaders");
            return -1;
        }
        uint32_t want = c->nalloc ? c->nalloc * 2 : 8;
        Leader *p = PyMem_Realloc(c->nodes, (size_t)want * sizeof(Leader));
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->nodes = p;
        c->nalloc = want;
    }
    size_t size = c->slots ? c->mask + 1 : 0;
    if (((size_t)c->n + 1) * 2 > size) {
        size_t want = size ? size * 2 : MIN_SLOTS;
        uint64_t *ns = PyMem_Calloc(want, sizeof(uint64_t));
        if (ns == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i < size; i++) {
            uint64_t s = c->slots[i];
            if (s) slot_put(ns, want - 1, (uint32_t)(s >> 32), (uint32_t)s - 1);
        }
        PyMem_Free(c->slots);
        c->slots = ns;
        c->mask = want - 1;
    }
    return 0;
}

static inline void list_unlink(Core *c, uint32_t i) {
    Leader *L = &c->nodes[i];
    if (L->prev != NIL) c->nodes[L->prev].next = L->next;
    else c->head = L->next;
    if (L->next != NIL) c->nodes[L->next].prev = L->prev;
    else c->tail = L->prev;
}

static inline void list_append(Core *c, uint32_t i) {
    Leader *L = &c->nodes[i];
    L->prev = c->tail;
    L->next = NIL;
    if (c->tail != NIL) c->nodes[c->tail].next = i;
    else c->head = i;
    c->tail = i;
}

/* Node idx (free, below n) becomes `key` at the most recent end, without followers (slot reserved). */
static void core_place(Core *c, uint32_t idx, const int32_t *key, uint32_t hash, int ll) {
    Leader *L = &c->nodes[idx];
    memset(L, 0, sizeof *L);
    memcpy(L->key, key, (size_t)ll * sizeof(int32_t));
    L->hash = hash;
    slot_put(c->slots, c->mask, hash, idx);
    list_append(c, idx);
}

/* ---- the table's operations ----------------------------------------------------------------------- */

/* Record that `fol` followed `lead` (whose hash_key is `hash`); -1 with MemoryError and nothing changed. */
static int table_insert_hashed(LRUTable *t, const int32_t *lead, const int32_t *fol, uint32_t hash) {
    Core *c = &t->c;
    const int ll = t->ll, fl = t->fl, stride = t->stride;
    uint32_t idx = core_find(c, lead, hash, ll);
    Leader *L;

    if (idx == NIL) {
        uint32_t first = t->follower_capacity < FIRST_FOLLOWERS ? (uint32_t)t->follower_capacity : FIRST_FOLLOWERS;
        int32_t *recs = PyMem_Malloc((size_t)first * stride * sizeof(int32_t));
        if (recs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if ((Py_ssize_t)c->n >= t->leader_capacity) {
            /* evict the least recent leader with all its followers and reuse its node */
            idx = c->head;
            L = &c->nodes[idx];
            slot_remove(c, L->hash, idx);
            list_unlink(c, idx);
            c->followers -= L->nfol;
            PyMem_Free(fol_base(L, stride));
        } else if (core_reserve(c) < 0) {
            PyMem_Free(recs);
            return -1;
        } else {
            idx = c->n++;
        }
        core_place(c, idx, lead, hash, ll);
        L = &c->nodes[idx];
        L->fol = recs;
        L->capfol = first;
        rec_write(recs, fol, fl, 1);
        L->nfol = 1;
        c->followers++;
        t->version++;
        return 0;
    }

    L = &c->nodes[idx];
    int32_t *r = L->fol;
    const uint32_t n = L->nfol;
    int64_t j;
    for (j = (int64_t)n - 1; j >= 0; j--)
        if (tokens_equal(r + j * stride, fol, fl)) break;
    if (j >= 0) {
        /* a known follower: counted, and moved to the most recent end */
        int64_t count = rec_count(r + j * stride, fl);
        if (j != (int64_t)n - 1)
            memmove(r + j * stride, r + (j + 1) * stride, (size_t)(n - 1 - j) * stride * sizeof(int32_t));
        rec_write(r + (size_t)(n - 1) * stride, fol, fl, count < INT64_MAX ? count + 1 : count);
    } else if ((Py_ssize_t)n >= t->follower_capacity) {
        /* full: the least recent follower makes room. The records slide one place along an allocation a quarter
         * larger than they need, and are moved back to its start only once they reach its end: a follower
         * dropped costs a few records moved on average, not all of them. */
        if ((size_t)L->lo + n < L->capfol) {
            L->lo++;
            L->fol = r = r + stride;
        } else {
            uint32_t room = n + (n >= 4 ? n / 4 : 1);
            int32_t *base = fol_base(L, stride);
            if (L->capfol < room) {
                int32_t *p = PyMem_Realloc(base, (size_t)room * stride * sizeof(int32_t));
                if (p == NULL) {
                    PyErr_NoMemory();
                    return -1;
                }
                base = p;
                L->capfol = room;
            }
            memmove(base, base + ((size_t)L->lo + 1) * stride, (size_t)(n - 1) * stride * sizeof(int32_t));
            L->lo = 0;
            L->fol = r = base;
        }
        rec_write(r + (size_t)(n - 1) * stride, fol, fl, 1);
    } else {
        if ((size_t)L->lo + n == L->capfol) {  /* (lo is 0 until the leader is full) */
            size_t want = (size_t)L->capfol * 2;
            if ((Py_ssize_t)want > t->follower_capacity) want = (size_t)t->follower_capacity;
            int32_t *p = PyMem_Realloc(fol_base(L, stride), want * stride * sizeof(int32_t));
            if (p == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            L->fol = r = p;
            L->capfol = (uint32_t)want;
        }
        rec_write(r + (size_t)n * stride, fol, fl, 1);
        L->nfol = n + 1;
        c->followers++;
    }
    if (c->tail != idx) {
        list_unlink(c, idx);
        list_append(c, idx);
    }
    t->version++;
    return 0;
}

/* The node a hash slot points to for `hash` if its stored hash matches (no key compared; for reading ahead only). */
static inline const Leader *node_hint(const Core *c, uint32_t hash) {
    uint64_t sv = c->slots[hash & c->mask];
    return sv && (uint32_t)(sv >> 32) == hash && (uint32_t)sv - 1 < c->n ? &c->nodes[(uint32_t)sv - 1] : NULL;
}

/* Every (leader, follower) pair of tokens[first, n), in order (table_insert), the memory each insert reads fetched
 * ahead: the leader's hash slot, then its node, then the most recent end of its followers (where a follower is
 * searched first); each leader hashed once. Updates are most of what storing a request costs. The pairs inserted,
 * or -1 with MemoryError. */
static Py_ssize_t insert_run(LRUTable *t, const int32_t *tok, Py_ssize_t first, Py_ssize_t n) {
    const int ll = t->ll;
    const Py_ssize_t last = n - (ll + t->fl);  /* the last pair's position */
    const Core *c = &t->c;
    enum { SLOT_AHEAD = 12, NODE_AHEAD = 6, FOLLOWERS_AHEAD = 3, RING = 16 };
    uint32_t hashes[RING];  /* hashes[p & (RING - 1)]: position p's leader, for p in [i, i + SLOT_AHEAD] */
    for (Py_ssize_t p = first; p <= last && p < first + SLOT_AHEAD; p++)
        hashes[p & (RING - 1)] = hash_key(tok + p, ll);
    Py_ssize_t pairs = 0;
    for (Py_ssize_t i = first; i <= last; i++, pairs++) {
        Py_ssize_t ahead = i + SLOT_AHEAD;
        if (ahead <= last) hashes[ahead & (RING - 1)] = hash_key(tok + ahead, ll);
        if (c->slots != NULL) {
            const Leader *L;
            if (ahead <= last) __builtin_prefetch(&c->slots[hashes[ahead & (RING - 1)] & c->mask]);
            if (i + NODE_AHEAD <= last && (L = node_hint(c, hashes[(i + NODE_AHEAD) & (RING - 1)])) != NULL)
                __builtin_prefetch(L);
            if (i + FOLLOWERS_AHEAD <= last &&
                (L = node_hint(c, hashes[(i + FOLLOWERS_AHEAD) & (RING - 1)])) != NULL && L->nfol) {
                const int32_t *end = L->fol + (size_t)(L->nfol - 1) * t->stride;
                __builtin_prefetch(end);
                __builtin_prefetch(end - 16);
            }
        }
        if (table_insert_hashed(t, tok + i, tok + i + ll, hashes[i & (RING - 1)]) < 0) return -1;
    }
    return pairs;
}

static int table_insert(LRUTable *t, const int32_t *lead, const int32_t *fol) {
    return table_insert_hashed(t, lead, fol, hash_key(lead, t->ll));
}

static int cmp_width; /* tokens compared by cmp_records (set right before qsort; the GIL is held) */

static int cmp_records(const void *a, const void *b) {
    const int32_t *x = a, *y = b;
    for (int i = 0; i < cmp_width; i++)
        if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
    return 0;
}

#define FAIL(...)                                         \
    do {                                                  \
        PyErr_Format(PyExc_AssertionError, __VA_ARGS__);  \
        goto fail;                                        \
    } while (0)

/* 0 when `c` obeys every rule for the table's sizes, else -1 with AssertionError. */
static int core_check(const Core *c, const LRUTable *t) {
    const int ll = t->ll, fl = t->fl, stride = t->stride;
    int32_t *sorted = NULL;
    if ((Py_ssize_t)c->n > t->leader_capacity)
        FAIL("too many leaders: %u > %zd", c->n, t->leader_capacity);
    uint32_t seen = 0, prev = NIL;
    for (uint32_t i = c->head; i != NIL; i = c->nodes[i].next) {
        if (i >= c->n) FAIL("recency list points past the leaders");
        if (c->nodes[i].prev != prev) FAIL("recency list broken at leader node %u", i);
        if (++seen > c->n) FAIL("recency list has a cycle");
        prev = i;
    }
    if (seen != c->n || c->tail != prev) FAIL("recency list holds %u of %u leaders", seen, c->n);
    size_t used = 0;
    for (size_t s = 0; c->slots && s <= c->mask; s++) {
        uint64_t v = c->slots[s];
        if (v == 0) continue;
        used++;
        uint32_t idx = (uint32_t)v - 1;
        if (idx >= c->n || c->nodes[idx].hash != (uint32_t)(v >> 32)) FAIL("hash slot %zu is stale", s);
    }
    if (used != c->n) FAIL("hash table holds %zu slots for %u leaders", used, c->n);
    int64_t total = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        const Leader *L = &c->nodes[i];
        for (int k = 0; k < ll; k++)
            if (L->key[k] < 0) FAIL("leader node %u holds a negative token id", i);
        if (L->hash != hash_key(L->key, ll) || core_find(c, L->key, L->hash, ll) != i)
            FAIL("leader node %u is not found by its tokens", i);
        if (L->nfol < 1 || (Py_ssize_t)L->nfol > t->follower_capacity || (size_t)L->lo + L->nfol > L->capfol)
            FAIL("leader node %u holds %u followers", i, L->nfol);
        for (uint32_t j = 0; j < L->nfol; j++) {
            const int32_t *r = L->fol + (size_t)j * stride;
            for (int k = 0; k < fl; k++)
                if (r[k] < 0) FAIL("follower %u of leader node %u holds a negative token id", j, i);
            if (rec_count(r, fl) < 1) FAIL("follower %u of leader node %u has count below 1", j, i);
        }
        if (L->nfol > 1) {
            size_t bytes = (size_t)L->nfol * stride * sizeof(int32_t);
            int32_t *p = PyMem_Realloc(sorted, bytes);
            if (p == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            sorted = p;
            memcpy(sorted, L->fol, bytes);
            cmp_width = fl;
            qsort(sorted, L->nfol, (size_t)stride * sizeof(int32_t), cmp_records);
            for (uint32_t j = 1; j < L->nfol; j++)
                if (tokens_equal(sorted + (size_t)(j - 1) * stride, sorted + (size_t)j * stride, fl))
                    FAIL("leader node %u holds a follower twice", i);
        }
        total += L->nfol;
    }
    if (total != c->followers) FAIL("follower total %lld, counted %lld", (long long)c->followers, (long long)total);
    PyMem_Free(sorted);
    return 0;
fail:
    PyMem_Free(sorted);
    return -1;
}

#undef FAIL

/* ---- converting arguments ------------------------------------------------------------------------- */

/* 1: stored in *out; 0: an integer outside [0, 2**31) and strict is 0 (no error set); -1: error. */
static inline int to_token(PyObject *o, int32_t *out, int strict) {
    long v;
    int overflow;
    if (PyLong_CheckExact(o)) {
        v = PyLong_AsLongAndOverflow(o, &overflow);
    } else {
        PyObject *i = PyNumber_Index(o);
        if (i == NULL) return -1;
        v = PyLong_AsLongAndOverflow(i, &overflow);
        Py_DECREF(i);
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < 0 || v > INT32_MAX) {
        if (!strict) return 0;
        PyErr_Format(PyExc_ValueError, "token id %R is outside [0, 2**31)", o);
        return -1;
    }
    *out = (int32_t)v;
    return 1;
}

/* Element kind of a 1-d integer buffer: 1 signed, 2 unsigned, 0 anything else (read it item by item). */
static int buffer_kind(const Py_buffer *b) {
    if (b->ndim != 1) return 0;
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=') f++;
#if PY_LITTLE_ENDIAN
    else if (*f == '<') f++;
#endif
    if (f[0] == '\0' || f[1] != '\0') return 0;
    if (b->itemsize != 1 && b->itemsize != 2 && b->itemsize != 4 && b->itemsize != 8) return 0;
    if (strchr("bhilqn", f[0])) return 1;
    if (strchr("BHILQN?", f[0])) return 2;
    return 0;
}

/* Items [start, start + count) of a buffer of kind `kind`; same results as to_token. */
static int read_buffer(const Py_buffer *b, int kind, Py_ssize_t start, Py_ssize_t count, int32_t *out,
                       int strict) {
    const char *p = (const char *)b->buf + start * b->strides[0];
    const Py_ssize_t step = b->strides[0];
    for (Py_ssize_t i = 0; i < count; i++, p += step) {
        int64_t v;
        if (kind == 1) {
            switch (b->itemsize) {
            case 1: { int8_t x; memcpy(&x, p, 1); v = x; break; }
            case 2: { int16_t x; memcpy(&x, p, 2); v = x; break; }
            case 4: { int32_t x; memcpy(&x, p, 4); v = x; break; }
            default: { int64_t x; memcpy(&x, p, 8); v = x; break; }
            }
        } else {
            uint64_t u;
            switch (b->itemsize) {
            case 1: { uint8_t x; memcpy(&x, p, 1); u = x; break; }
            case 2: { uint16_t x; memcpy(&x, p, 2); u = x; break; }
            case 4: { uint32_t x; memcpy(&x, p, 4); u = x; break; }
            default: { memcpy(&u, p, 8); break; }
            }
            v = u > INT32_MAX ? -1 : (int64_t)u;
        }
        if (v < 0 || v > INT32_MAX) {
            if (!strict) return 0;
            PyErr_Format(PyExc_ValueError, "token id at index %zd is outside [0, 2**31)", start + i);
            return -1;
        }
        out[i] = (int32_t)v;
    }
    return 1;
}

/* Items [start, start + count) of a list or tuple, re-checking its size (an __index__ may change it). */
static int read_fast(PyObject *fast, Py_ssize_t start, Py_ssize_t count, int32_t *out, int strict) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (start + i >= PySequence_Fast_GET_SIZE(fast)) {
            PyErr_SetString(PyExc_RuntimeError, "sequence changed size during conversion");
            return -1;
        }
        PyObject *o = PySequence_Fast_GET_ITEM(fast, start + i);
        Py_INCREF(o);
        int r = to_token(o, out + i, strict);
        Py_DECREF(o);
        if (r <= 0) return r;
    }
    return 1;
}

/* A sequence of exactly `want` token ids (a leader or a follower) into out[0 .. want-1].
 * 1: done; 0: not a possible key (wrong length, or an id outside [0, 2**31)) and strict is 0; -1: error
 * (strict: ValueError naming `what` for those cases). */
static int read_key(PyObject *seq, int32_t *out, Py_ssize_t want, int strict, const char *what) {
    Py_ssize_t n;
    int r;
    if (PyTuple_CheckExact(seq) || PyList_CheckExact(seq)) {
        n = PySequence_Fast_GET_SIZE(seq);
        if (n != want) goto wrong_length;
        return read_fast(seq, 0, n, out, strict);
    }
    if (PyObject_CheckBuffer(seq)) {
        Py_buffer b;
        if (PyObject_GetBuffer(seq, &b, PyBUF_RECORDS_RO) == 0) {
            int kind = buffer_kind(&b);
            if (kind) {
                n = b.shape[0];
                r = n == want ? read_buffer(&b, kind, 0, n, out, strict) : 2;
                PyBuffer_Release(&b);
                if (r == 2) goto wrong_length;
                return r;
            }
            PyBuffer_Release(&b);
        } else {
            PyErr_Clear();
        }
    }
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of token ids");
    if (fast == NULL) return -1;
    n = PySequence_Fast_GET_SIZE(fast);
    r = n == want ? read_fast(fast, 0, n, out, strict) : 2;
    Py_DECREF(fast);
    if (r == 2) goto wrong_length;
    return r;
wrong_length:
    if (!strict) return 0;
    PyErr_Format(PyExc_ValueError, "expected a %zd-token %s, got %zd tokens", want, what, n);
    return -1;
}

/* FASTCALL arguments by position or name into out[] (borrowed, NULL when absent). */
static int parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      const char *const *names, int nnames, int required, PyObject **out) {
    for (int j = 0; j < nnames; j++) out[j] = NULL;
    if (nargs > nnames) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, nnames, nargs);
        return -1;
    }
    for (Py_ssize_t j = 0; j < nargs; j++) out[j] = args[j];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < nnames && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) j++;
        if (j == nnames) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname, key);
            return -1;
        }
        if (out[j] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, names[j]);
            return -1;
        }
        out[j] = args[nargs + k];
    }
    for (int j = 0; j < required; j++) {
        if (out[j] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[j]);
            return -1;
        }
    }
    return 0;
}

/* ---- building results ----------------------------------------------------------------------------- */

/* Python ints for token ids below INT_CACHE, made on first use and kept for the life of the process
 * (at most 2 MiB of pointers, allocated lazily by the system, plus one int per distinct id returned):
 * building a query's result then costs no int allocations. */
#define INT_CACHE (1 << 18)
static PyObject **int_cache;

static inline PyObject *token_int(int32_t v) {
    if ((uint32_t)v >= INT_CACHE) return PyLong_FromLong(v);
    if (int_cache == NULL) {
        int_cache = calloc(INT_CACHE, sizeof(PyObject *));
        if (int_cache == NULL) return PyLong_FromLong(v);
    }
    PyObject *o = int_cache[v];
    if (o == NULL) {
        o = PyLong_FromLong(v);
        if (o == NULL) return NULL;
        int_cache[v] = o;
    }
    Py_INCREF(o);
    return o;
}

static PyObject *tokens_tuple(const int32_t *k, int n) {
    PyObject *tup = PyTuple_New(n);
    if (tup == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *v = token_int(k[i]);
        if (v == NULL) {
            Py_DECREF(tup);
            return NULL;
        }
        PyTuple_SET_ITEM(tup, i, v);
    }
    return tup;
}

/* (follower tokens, count) of one record. */
static PyObject *follower_pair(const int32_t *r, int fl) {
    PyObject *pair = PyTuple_New(2);
    if (pair == NULL) return NULL;
    PyObject *tup = tokens_tuple(r, fl);
    if (tup == NULL) {
        Py_DECREF(pair);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, tup);
    PyObject *cnt = PyLong_FromLongLong(rec_count(r, fl));
    if (cnt == NULL) {
        Py_DECREF(pair);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 1, cnt);
    return pair;
}

/* ---- the LRUTable type ---------------------------------------------------------------------------- */

static PyObject *LRUTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"leader_len", "follower_len", "leader_capacity", "follower_capacity", NULL};
    Py_ssize_t v[4] = {1, 3, (Py_ssize_t)1 << 20, 128};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|nnnn:LRUTable", kwlist, &v[0], &v[1], &v[2], &v[3]))
        return NULL;
    for (int i = 0; i < 4; i++) {
        if (v[i] < 1) {
            PyErr_Format(PyExc_ValueError, "%s must be at least 1, got %zd", kwlist[i], v[i]);
            return NULL;
        }
    }
    for (int i = 0; i < 2; i++) {
        if (v[i] > MAX_LEN) {
            PyErr_Format(PyExc_ValueError, "%s must be at most %d, got %zd", kwlist[i], MAX_LEN, v[i]);
            return NULL;
        }
    }
    if (v[3] > (Py_ssize_t)(NIL / 2)) {
        PyErr_Format(PyExc_ValueError, "follower_capacity must be below 2**31, got %zd", v[3]);
        return NULL;
    }
    LRUTable *t = (LRUTable *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->leader_len = v[0];
    t->follower_len = v[1];
    t->leader_capacity = v[2];
    t->follower_capacity = v[3];
    t->ll = (int)v[0];
    t->fl = (int)v[1];
    t->stride = t->fl + 2;
    memset(&t->c, 0, sizeof t->c);
    t->c.head = t->c.tail = NIL;
    t->version = 0;
    return (PyObject *)t;
}

static void LRUTable_dealloc(LRUTable *t) {
    core_free(&t->c, t->stride);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t LRUTable_len(LRUTable *t) { return (Py_ssize_t)t->c.n; }

static int LRUTable_contains(LRUTable *t, PyObject *leader) {
    int32_t key[MAX_LEN];
    int r = read_key(leader, key, t->ll, 0, "leader");
    if (r <= 0) return r;
    return core_find(&t->c, key, hash_key(key, t->ll), t->ll) != NIL;
}

PyDoc_STRVAR(insert_doc,
"insert(leader, follower)\n--\n\n"
"Record that ``follower`` came right after ``leader``.\n\n"
"Raises:\n    ValueError: on a leader or follower of the wrong length, or a token id outside [0, 2**31).");

static PyObject *LRUTable_insert(LRUTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"leader", "follower"};
    PyObject *a[2];
    if (parse_args("insert", args, nargs, kwnames, names, 2, 2, a) < 0) return NULL;
    int32_t lead[MAX_LEN], fol[MAX_LEN];
    if (read_key(a[0], lead, t->ll, 1, "leader") < 0) return NULL;
    if (read_key(a[1], fol, t->fl, 1, "follower") < 0) return NULL;
    if (table_insert(t, lead, fol) < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(query_doc,
"query(leader, limit=None)\n--\n\n"
"Followers of ``leader``, most recently inserted first, with their insertion counts.\n\n"
"Refreshes the leader's recency; followers keep their order. An unknown leader (or one of the wrong\n"
"length, or with an id outside [0, 2**31)) gives an empty list. As in the reference, a limit below one\n"
"still returns the first follower.");

static PyObject *LRUTable_query(LRUTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"leader", "limit"};
    PyObject *a[2];
    if (kwnames == NULL && nargs >= 1 && nargs <= 2) {
        a[0] = args[0];
        a[1] = nargs == 2 ? args[1] : NULL;
    } else if (parse_args("query", args, nargs, kwnames, names, 2, 1, a) < 0) {
        return NULL;
    }
    Py_ssize_t limit = PY_SSIZE_T_MAX;
    if (a[1] != NULL && a[1] != Py_None) {
        limit = PyNumber_AsSsize_t(a[1], NULL);
        if (limit == -1 && PyErr_Occurred()) return NULL;
        if (limit < 1) limit = 1;
    }
    int32_t key[MAX_LEN];
    int r = read_key(a[0], key, t->ll, 0, "leader");
    if (r < 0) return NULL;
    Core *c = &t->c;
    uint32_t idx = r ? core_find(c, key, hash_key(key, t->ll), t->ll) : NIL;
    if (idx == NIL) return PyList_New(0);
    if (c->tail != idx) {
        list_unlink(c, idx);
        list_append(c, idx);
        t->version++;
    }
    const Leader *L = &c->nodes[idx];
    Py_ssize_t k = (Py_ssize_t)L->nfol < limit ? (Py_ssize_t)L->nfol : limit;
    PyObject *out = PyList_New(k);
    if (out == NULL) return NULL;
    const int fl = t->fl, stride = t->stride;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *pair = follower_pair(L->fol + (size_t)(L->nfol - 1 - i) * stride, fl);
        if (pair == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    return out;
}

PyDoc_STRVAR(update_doc,
"update(tokens, new_from=0)\n--\n\n"
"Slide a window over ``tokens`` and insert every leader-follower pair that ends at or after ``new_from``.\n\n"
"Args:\n"
"    tokens: the sequence (a list, tuple, integer array or any sliceable sequence of ints); only its last\n"
"        ``new tokens + LL + FL`` are read.\n"
"    new_from: index of the first token not seen by an earlier update of this sequence.\n\n"
"Returns:\n    Number of pairs inserted.\n\n"
"Raises:\n    ValueError: on a token id outside [0, 2**31) among the tokens read (nothing is inserted).");

static PyObject *LRUTable_update(LRUTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"tokens", "new_from"};
    PyObject *a[2];
    if (parse_args("update", args, nargs, kwnames, names, 2, 1, a) < 0) return NULL;
    Py_ssize_t new_from = 0;
    if (a[1] != NULL) {
        new_from = PyNumber_AsSsize_t(a[1], NULL); /* clipped to the Py_ssize_t range */
        if (new_from == -1 && PyErr_Occurred()) return NULL;
    }
    const Py_ssize_t span = t->ll + t->fl;
    const Py_ssize_t first = new_from > span - 1 ? new_from - span + 1 : 0;

    int32_t stack[STACK_TOKENS];
    int32_t *buf = stack;
    PyObject *fast = NULL, *owned = NULL;
    Py_buffer view;
    int have_view = 0, kind = 0;
    Py_ssize_t m = 0;
    int r = 1;

    PyObject *tokens = a[0];
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        fast = tokens;
    } else {
        if (PyObject_CheckBuffer(tokens)) {
            if (PyObject_GetBuffer(tokens, &view, PyBUF_RECORDS_RO) == 0) {
                kind = buffer_kind(&view);
                if (kind) have_view = 1;
                else PyBuffer_Release(&view);
            } else {
                PyErr_Clear();
            }
        }
        if (!have_view) {
            /* like the reference: tokens[first:], then item by item */
            PyObject *start = PyLong_FromSsize_t(first);
            if (start == NULL) return NULL;
            PyObject *sl = PySlice_New(start, NULL, NULL);
            Py_DECREF(start);
            if (sl == NULL) return NULL;
            PyObject *tail = PyObject_GetItem(tokens, sl);
            Py_DECREF(sl);
            if (tail == NULL) return NULL;
            owned = PySequence_Fast(tail, "tokens must be a sequence of token ids");
            Py_DECREF(tail);
            if (owned == NULL) return NULL;
            fast = owned;
        }
    }
    Py_ssize_t start = 0;
    if (have_view) {
        start = first < view.shape[0] ? first : view.shape[0];
        m = view.shape[0] - start;
    } else if (owned) {
        m = PySequence_Fast_GET_SIZE(fast);
    } else {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
        start = first < n ? first : n;
        m = n - start;
    }
    if (m > STACK_TOKENS) {
        buf = PyMem_Malloc((size_t)m * sizeof(int32_t));
        if (buf == NULL) {
            PyErr_NoMemory();
            r = -1;
            goto done;
        }
    }
    r = have_view ? read_buffer(&view, kind, start, m, buf, 1) : read_fast(fast, start, m, buf, 1);
    if (r < 0) goto done;
    if ((m = insert_run(t, buf, 0, m)) < 0) r = -1;
done:
    if (have_view) PyBuffer_Release(&view);
    Py_XDECREF(owned);
    if (buf != stack) PyMem_Free(buf);
    return r < 0 ? NULL : PyLong_FromSsize_t(m);
}

PyDoc_STRVAR(arrays_doc,
"arrays()\n--\n\n"
"What items() yields, as four buffers in the same orders, without a Python object per leader or follower:\n"
"(leaders: int32 (L * LL), fanout: int32 (L), followers: int32 (F * FL), counts: int64 (F)), native byte order.\n"
"A snapshot takes it in one call, however large the table.");

static PyObject *LRUTable_arrays(LRUTable *t, PyObject *Py_UNUSED(ignored)) {
    const Core *c = &t->c;
    Py_ssize_t nl = 0, nf = 0;
    for (uint32_t i = c->head; i != NIL; i = c->nodes[i].next) {
        nl++;
        nf += c->nodes[i].nfol;
    }
    PyObject *lead = PyBytes_FromStringAndSize(NULL, nl * t->ll * (Py_ssize_t)sizeof(int32_t));
    PyObject *fan = PyBytes_FromStringAndSize(NULL, nl * (Py_ssize_t)sizeof(int32_t));
    PyObject *fols = PyBytes_FromStringAndSize(NULL, nf * t->fl * (Py_ssize_t)sizeof(int32_t));
    PyObject *cnts = PyBytes_FromStringAndSize(NULL, nf * (Py_ssize_t)sizeof(int64_t));
    if (lead == NULL || fan == NULL || fols == NULL || cnts == NULL) {
        Py_XDECREF(lead);
        Py_XDECREF(fan);
        Py_XDECREF(fols);
        Py_XDECREF(cnts);
        return NULL;
    }
    char *pl = PyBytes_AS_STRING(lead), *pa = PyBytes_AS_STRING(fan), *pf = PyBytes_AS_STRING(fols);
    char *pc = PyBytes_AS_STRING(cnts);
    for (uint32_t i = c->head; i != NIL; i = c->nodes[i].next) {
        const Leader *L = &c->nodes[i];
        memcpy(pl, L->key, (size_t)t->ll * sizeof(int32_t));
        pl += (size_t)t->ll * sizeof(int32_t);
        int32_t n = (int32_t)L->nfol;
        memcpy(pa, &n, sizeof n);
        pa += sizeof n;
        for (uint32_t j = 0; j < L->nfol; j++) {
            const int32_t *r = L->fol + (size_t)j * t->stride;
            memcpy(pf, r, (size_t)t->fl * sizeof(int32_t));
            pf += (size_t)t->fl * sizeof(int32_t);
            int64_t count = rec_count(r, t->fl);
            memcpy(pc, &count, sizeof count);
            pc += sizeof count;
        }
    }
    return Py_BuildValue("(NNNN)", lead, fan, fols, cnts);
}

PyDoc_STRVAR(items_doc,
"items()\n--\n\n"
"Iterator over leaders least recent first, each as (leader, [(follower, count), ...]) with its followers\n"
"least recent first (for snapshots). Changing the table while iterating raises RuntimeError.");

static PyObject *LRUTable_items(LRUTable *t, PyObject *Py_UNUSED(ignored)) {
    ItemsIter *it = PyObject_New(ItemsIter, &ItemsIterType);
    if (it == NULL) return NULL;
    Py_INCREF(t);
    it->table = t;
    it->cur = t->c.head;
    it->version = t->version;
    return (PyObject *)it;
}

/* Unpack an iterable of exactly two items into new references. */
static int unpack2(PyObject *o, PyObject **x, PyObject **y) {
    PyObject *fast = PySequence_Fast(o, "expected a pair");
    if (fast == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != 2) {
        PyErr_Format(PyExc_ValueError, "expected a pair, got %zd values", PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    *x = PySequence_Fast_GET_ITEM(fast, 0);
    *y = PySequence_Fast_GET_ITEM(fast, 1);
    Py_INCREF(*x);
    Py_INCREF(*y);
    Py_DECREF(fast);
    return 0;
}

/* Read one snapshot entry (leader, followers) into `c`; a leader seen before keeps its place and gets the
 * new followers; a follower seen before under the same leader keeps its place and gets the new count. */
static int load_entry(LRUTable *t, Core *c, PyObject *entry) {
    const int ll = t->ll, fl = t->fl, stride = t->stride;
    PyObject *lead = NULL, *fols = NULL, *iter = NULL, *pair = NULL;
    int32_t key[MAX_LEN], fol[MAX_LEN];
    int ret = -1;
    if (unpack2(entry, &lead, &fols) < 0) return -1;
    int r = read_key(lead, key, ll, 0, "leader");
    if (r < 0) goto done;
    if (r == 0) {
        /* tell a wrong length (a broken snapshot) from an id outside int32 */
        Py_ssize_t n = PyObject_Length(lead);
        if (n < 0) goto done;
        if (n == ll) {
            read_key(lead, key, ll, 1, "leader");
        } else {
            PyErr_Format(PyExc_AssertionError, "leader %R has the wrong length", lead);
        }
        goto done;
    }
    uint32_t hash = hash_key(key, ll);
    uint32_t idx = core_find(c, key, hash, ll);
    if (idx == NIL) {
        if (core_reserve(c) < 0) goto done;
        idx = c->n++;
        core_place(c, idx, key, hash, ll);
    } else {
        c->followers -= c->nodes[idx].nfol;
        c->nodes[idx].nfol = 0;
    }
    iter = PyObject_GetIter(fols);
    if (iter == NULL) goto done;
    while ((pair = PyIter_Next(iter)) != NULL) {
        PyObject *f, *cnt;
        if (unpack2(pair, &f, &cnt) < 0) goto done;
        r = read_key(f, fol, fl, 0, "follower");
        if (r == 0) {
            Py_ssize_t n = PyObject_Length(f);
            if (n == fl) read_key(f, fol, fl, 1, "follower");
            else if (n >= 0) PyErr_Format(PyExc_AssertionError, "bad follower %R of %R", f, lead);
            r = -1;
        }
        long long count = 0;
        if (r > 0) {
            PyObject *num = PyNumber_Long(cnt);
            if (num == NULL) {
                r = -1;
            } else {
                count = PyLong_AsLongLong(num);
                Py_DECREF(num);
                if (count == -1 && PyErr_Occurred()) r = -1;
                else if (count < 1) {
                    PyErr_Format(PyExc_AssertionError, "bad follower %R of %R", f, lead);
                    r = -1;
                }
            }
        }
        Py_DECREF(f);
        Py_DECREF(cnt);
        if (r < 0) goto done;
        Py_CLEAR(pair);
        Leader *L = &c->nodes[idx];
        uint32_t j = 0;
        while (j < L->nfol && !tokens_equal(L->fol + (size_t)j * stride, fol, fl)) j++;
        if (j == L->nfol) {
            if (L->lo + L->nfol == L->capfol) {  /* a node being loaded: lo is 0 */
                if (L->capfol >= NIL / 2) {
                    PyErr_SetString(PyExc_MemoryError, "too many followers");
                    goto done;
                }
                uint32_t want = L->capfol ? L->capfol * 2 : FIRST_FOLLOWERS;
                int32_t *p = PyMem_Realloc(fol_base(L, stride), (size_t)want * stride * sizeof(int32_t));
                if (p == NULL) {
                    PyErr_NoMemory();
                    goto done;
                }
                L->fol = p;
                L->capfol = want;
            }
            L->nfol++;
            c->followers++;
        }
        rec_write(L->fol + (size_t)j * stride, fol, fl, count);
    }
    if (PyErr_Occurred()) goto done;
    ret = 0;
done:
    Py_XDECREF(pair);
    Py_XDECREF(iter);
    Py_XDECREF(lead);
    Py_XDECREF(fols);
    return ret;
}

PyDoc_STRVAR(load_doc,
"load(items)\n--\n\n"
"Replace the contents with ``items`` as produced by ``items()`` (order is recency).\n\n"
"Raises:\n"
"    AssertionError: when the snapshot breaks a capacity or shape rule (the table is left unchanged).\n"
"    ValueError: on a token id outside [0, 2**31).");

static PyObject *LRUTable_load(LRUTable *t, PyObject *items) {
    Core nc;
    memset(&nc, 0, sizeof nc);
    nc.head = nc.tail = NIL;
    PyObject *iter = PyObject_GetIter(items), *entry;
    if (iter == NULL) return NULL;
    while ((entry = PyIter_Next(iter)) != NULL) {
        int r = load_entry(t, &nc, entry);
        Py_DECREF(entry);
        if (r < 0) break;
    }
    Py_DECREF(iter);
    if (PyErr_Occurred() || core_check(&nc, t) < 0) {
        core_free(&nc, t->stride);
        return NULL;
    }
    core_free(&t->c, t->stride);
    t->c = nc;
    t->version++;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(check_doc,
"check_invariants()\n--\n\n"
"Raise AssertionError when a capacity, shape, hash-table or recency-list rule is broken.");

static PyObject *LRUTable_check_invariants(LRUTable *t, PyObject *Py_UNUSED(ignored)) {
    if (core_check(&t->c, t) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *LRUTable_reduce(LRUTable *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *it = LRUTable_items(t, NULL);
    if (it == NULL) return NULL;
    PyObject *state = PySequence_List(it);
    Py_DECREF(it);
    if (state == NULL) return NULL;
    return Py_BuildValue("O(nnnn)N", Py_TYPE(t), t->leader_len, t->follower_len, t->leader_capacity,
                         t->follower_capacity, state);
}

static PyObject *LRUTable_sizeof(LRUTable *t, PyObject *Py_UNUSED(ignored)) {
    size_t bytes = Py_TYPE(t)->tp_basicsize + (size_t)t->c.nalloc * sizeof(Leader);
    if (t->c.slots) bytes += (t->c.mask + 1) * sizeof(uint64_t);
    for (uint32_t i = 0; i < t->c.n; i++) bytes += (size_t)t->c.nodes[i].capfol * t->stride * sizeof(int32_t);
    return PyLong_FromSize_t(bytes);
}

static PyObject *LRUTable_get_followers(LRUTable *t, void *Py_UNUSED(closure)) {
    return PyLong_FromLongLong(t->c.followers);
}

static PyObject *LRUTable_repr(LRUTable *t) {
    return PyUnicode_FromFormat("LRUTable(leader_len=%zd, follower_len=%zd, leader_capacity=%zd, "
                                "follower_capacity=%zd) with %u leaders",
                                t->leader_len, t->follower_len, t->leader_capacity, t->follower_capacity, t->c.n);
}

static PyMethodDef LRUTable_methods[] = {
    {"insert", (PyCFunction)(void (*)(void))LRUTable_insert, METH_FASTCALL | METH_KEYWORDS, insert_doc},
    {"query", (PyCFunction)(void (*)(void))LRUTable_query, METH_FASTCALL | METH_KEYWORDS, query_doc},
    {"update", (PyCFunction)(void (*)(void))LRUTable_update, METH_FASTCALL | METH_KEYWORDS, update_doc},
    {"items", (PyCFunction)LRUTable_items, METH_NOARGS, items_doc},
    {"arrays", (PyCFunction)LRUTable_arrays, METH_NOARGS, arrays_doc},
    {"load", (PyCFunction)LRUTable_load, METH_O, load_doc},
    {"check_invariants", (PyCFunction)LRUTable_check_invariants, METH_NOARGS, check_doc},
    {"__reduce__", (PyCFunction)LRUTable_reduce, METH_NOARGS, "Pickle support: sizes and items()."},
    {"__setstate__", (PyCFunction)LRUTable_load, METH_O, "Pickle support: load(items)."},
    {"__sizeof__", (PyCFunction)LRUTable_sizeof, METH_NOARGS, "Bytes held, including native storage."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef LRUTable_members[] = {
    {"leader_len", T_PYSSIZET, offsetof(LRUTable, leader_len), READONLY, "LL, tokens in a leader."},
    {"follower_len", T_PYSSIZET, offsetof(LRUTable, follower_len), READONLY, "FL, tokens in a follower."},
    {"leader_capacity", T_PYSSIZET, offsetof(LRUTable, leader_capacity), READONLY, "LC, most leaders held."},
    {"follower_capacity", T_PYSSIZET, offsetof(LRUTable, follower_capacity), READONLY,
     "FC, most followers held per leader."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef LRUTable_getset[] = {
    {"followers", (getter)LRUTable_get_followers, NULL, "Followers held over all leaders.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods LRUTable_as_sequence = {
    .sq_length = (lenfunc)LRUTable_len,
    .sq_contains = (objobjproc)LRUTable_contains,
};

PyDoc_STRVAR(LRUTable_doc,
"LRUTable(leader_len=1, follower_len=3, leader_capacity=1 << 20, follower_capacity=128)\n--\n\n"
"The dynamic table: at most ``leader_capacity`` leaders, each with at most ``follower_capacity`` followers.\n\n"
"Rules (Cacheback): inserting or querying a leader makes it the most recent leader; inserting a follower\n"
"makes it the most recent follower of its leader and counts it; querying does not change followers' order.\n"
"When full, the least recent leader (with all its followers) or the least recent follower of a leader is\n"
"evicted. Leaders and followers hold at most 8 tokens; token ids lie in [0, 2**31).");

static PyTypeObject LRUTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "store._lru.LRUTable",
    .tp_basicsize = sizeof(LRUTable),
    .tp_dealloc = (destructor)LRUTable_dealloc,
    .tp_repr = (reprfunc)LRUTable_repr,
    .tp_as_sequence = &LRUTable_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = LRUTable_doc,
    .tp_methods = LRUTable_methods,
    .tp_members = LRUTable_members,
    .tp_getset = LRUTable_getset,
    .tp_new = LRUTable_new,
};

/* ---- items() iterator ----------------------------------------------------------------------------- */

static void ItemsIter_dealloc(ItemsIter *it) {
    Py_XDECREF(it->table);
    PyObject_Free(it);
}

static PyObject *ItemsIter_next(ItemsIter *it) {
    LRUTable *t = it->table;
    if (t == NULL) return NULL;
    if (it->cur == NIL) {
        Py_CLEAR(it->table);
        return NULL;
    }
    if (t->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "LRUTable changed during iteration");
        return NULL;
    }
    const Leader *L = &t->c.nodes[it->cur];
    PyObject *lead = tokens_tuple(L->key, t->ll);
    if (lead == NULL) return NULL;
    PyObject *fols = PyList_New(L->nfol);
    if (fols == NULL) {
        Py_DECREF(lead);
        return NULL;
    }
    for (uint32_t j = 0; j < L->nfol; j++) {
        PyObject *pair = follower_pair(L->fol + (size_t)j * t->stride, t->fl);
        if (pair == NULL) {
            Py_DECREF(lead);
            Py_DECREF(fols);
            return NULL;
        }
        PyList_SET_ITEM(fols, j, pair);
    }
    it->cur = L->next;
    return Py_BuildValue("NN", lead, fols);
}

static PyTypeObject ItemsIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "store._lru.LRUTableItems",
    .tp_basicsize = sizeof(ItemsIter),
    .tp_dealloc = (destructor)ItemsIter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Iterator over an LRUTable's leaders, least recent first.",
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)ItemsIter_next,
};

/* ---- module --------------------------------------------------------------------------------------- */

static void refresh(LRUTable *t, uint32_t idx) {
    Core *c = &t->c;
    if (c->tail != idx) {
        list_unlink(c, idx);
        list_append(c, idx);
        t->version++;
    }
}

static int capi_peek(PyObject *obj, const int32_t *leader, int limit, int32_t *out_tokens, int64_t *out_counts,
                     int *fl_out, uint32_t *where) {
    LRUTable *t = (LRUTable *)obj;
    const Core *c = &t->c;
    *fl_out = t->fl;
    uint32_t idx = core_find(c, leader, hash_key(leader, t->ll), t->ll);
    *where = idx;
    if (idx == NIL) return 0;
    const Leader *L = &c->nodes[idx];
    int k = (int)L->nfol < limit ? (int)L->nfol : limit;
    for (int i = 0; i < k; i++) {
        const int32_t *r = L->fol + (size_t)(L->nfol - 1 - i) * t->stride;
        memcpy(out_tokens + (size_t)i * t->fl, r, (size_t)t->fl * sizeof(int32_t));
        out_counts[i] = rec_count(r, t->fl);
    }
    return k;
}

static void capi_touch(PyObject *obj, const int32_t *leader, uint32_t where) {
    LRUTable *t = (LRUTable *)obj;
    const Core *c = &t->c;
    if (where == NIL || where >= c->n || !tokens_equal(c->nodes[where].key, leader, t->ll))
        where = core_find(c, leader, hash_key(leader, t->ll), t->ll);
    if (where != NIL) refresh(t, where);
}

static void capi_touch_many(PyObject *obj, const int32_t *leaders, const uint32_t *where, Py_ssize_t n) {
    LRUTable *t = (LRUTable *)obj;
    const Core *c = &t->c;
    enum { AHEAD = 8 };  /* a refresh reads its node, then its neighbours: both are fetched ahead */
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        if (where[i] < c->n) __builtin_prefetch(&c->nodes[where[i]]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n && where[i + AHEAD] < c->n) __builtin_prefetch(&c->nodes[where[i + AHEAD]]);
        if (i + AHEAD / 2 < n && where[i + AHEAD / 2] < c->n) {
            const Leader *L = &c->nodes[where[i + AHEAD / 2]];
            if (L->prev < c->n) __builtin_prefetch(&c->nodes[L->prev]);
            if (L->next < c->n) __builtin_prefetch(&c->nodes[L->next]);
        }
        capi_touch(obj, leaders + (size_t)i * (size_t)t->ll, where[i]);
    }
}

static int capi_query(PyObject *obj, const int32_t *leader, int limit, int32_t *out_tokens, int64_t *out_counts,
                      int *fl_out) {
    uint32_t where;
    int k = capi_peek(obj, leader, limit, out_tokens, out_counts, fl_out, &where);
    if (where != NIL) refresh((LRUTable *)obj, where);
    return k;
}

static int capi_leader_len(PyObject *obj) { return ((LRUTable *)obj)->ll; }

static Py_ssize_t capi_update(PyObject *obj, const int32_t *tokens, Py_ssize_t n, Py_ssize_t new_from) {
    LRUTable *t = (LRUTable *)obj;
    const Py_ssize_t span = t->ll + t->fl;
    Py_ssize_t first = new_from > span - 1 ? new_from - span + 1 : 0;
    if (first > n) first = n;
    for (Py_ssize_t i = first; i < n; i++)
        if (tokens[i] < 0) {
            PyErr_Format(PyExc_ValueError, "token id at index %zd is outside [0, 2**31)", i);
            return -1;
        }
    return insert_run(t, tokens, first, n);
}

static LRUTableCAPI c_api = {&LRUTableType, capi_query, capi_leader_len, capi_update, capi_peek, capi_touch,
                             capi_touch_many};

static struct PyModuleDef lru_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "store._lru",
    .m_doc = "Native LRU n-gram table (the dynamic Cacheback table); see store.ngram_table.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__lru(void) {
    if (PyType_Ready(&LRUTableType) < 0 || PyType_Ready(&ItemsIterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&lru_module);
    if (m == NULL) return NULL;
    Py_INCREF(&LRUTableType);
    if (PyModule_AddObject(m, "LRUTable", (PyObject *)&LRUTableType) < 0) {
        Py_DECREF(&LRUTableType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_LEN", MAX_LEN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(&c_api, "store._lru._C_API", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
