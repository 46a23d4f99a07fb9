/* Native best-first draft tree builder and draft scoring; the same algorithm as tree_builder.py. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include "_workers.h"

/* Evidence-key layout, identical to drafter_service/core/acceptance.py. */
#define N_MATCH 10
#define N_SHARE 5
#define N_COUNT 6
#define N_RANK 4
#define N_AGREE 11
#define ROWS_BASE 0
#define FOLLOWER_BASE (ROWS_BASE + 2 * N_MATCH * N_SHARE * N_COUNT)
#define FRESH_BASE (FOLLOWER_BASE + 2 * 2)
#define AGREE_BASE (FRESH_BASE + 2 * N_RANK * N_COUNT)
#define CONTESTED_BASE (AGREE_BASE + 16 * N_AGREE)
#define N_KEYS (CONTESTED_BASE + AGREE_BASE)
#define MAX_TABLES 8
#define MAX_LEADER 16
#define FOLLOWER_PRIOR 0.6

static const int MATCH_BUCKETS[] = {0, 1, 2, 3, 4, 5, 5, 6, 6, 7, 7, 7, 7, 8, 8, 8, 8};
static const int COUNT_BUCKETS[] = {0, 1, 2, 3, 3, 4, 4, 4, 4};

static int match_bucket(int m) { return m < 17 ? MATCH_BUCKETS[m] : 9; }
static int count_bucket(long c) { return c < 9 ? COUNT_BUCKETS[c] : 5; }
static int share_bucket(double s) { return s >= 1.0 ? 4 : (int)(s * 4); }
static double table_prior(int kind) { return kind == 2 ? 0.3 : 0.15; }

/* ---- growable buffers ---------------------------------------------------------------------- */

typedef struct { void *data; Py_ssize_t len, cap, item; } Buf;

/* Set on a thread while it drafts a batched step's sessions beside others (see steps): running out of memory then
 * raises nothing, since helper threads have no Python thread state; the step raises MemoryError for them. */
static _Thread_local int quiet;

/* Out of memory: MemoryError unless quiet (buffers come from the raw allocator, which any thread may use); -1. */
static int nomem(void) {
    if (!quiet) PyErr_NoMemory();
    return -1;
}

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra) cap *= 2;
    void *d = PyMem_RawRealloc(b->data, (size_t)(cap * b->item));
    if (!d) return nomem();
    b->data = d;
    b->cap = cap;
    return 0;
}
#define BUF(T) {NULL, 0, 0, sizeof(T)}
#define AT(b, T, i) (((T *)(b).data)[i])
static void buf_free(Buf *b) { PyMem_RawFree(b->data); b->data = NULL; b->len = b->cap = 0; }

/* ---- candidates and the heap --------------------------------------------------------------- */

typedef struct { int table, fol_off, fol_len, j; } State;   /* a table follower being walked */
typedef struct {
    double p;
    long seq;
    int parent, tok, depth, kinds;
    int rows_off, rows_len, st_off, st_len, ev_off, ev_len;
} Cand;

typedef struct {                                           /* one child gathered during an expansion */
    int tok, kinds, rank;
    long count;
    int here[2];                                            /* its rows of each kind */
    int rows_off, rows_len, st_off, st_len;                 /* into the gathered scratch arrays */
} Child;

typedef struct {
    /* inputs */
    const int *rows[2];
    Py_ssize_t nrows[2], width[2];
    int match_len[2];
    PyObject *tables[MAX_TABLES];
    int table_kind[MAX_TABLES], table_branch[MAX_TABLES], ntables, leader_len;
    const int *context_tail;
    int context_len;
    const double *acc, *trials;
    int max_nodes, max_depth, branch;
    double min_prob;
    int defer;  /* native tables are only read (peeked); their leaders' refreshes go to ``touches`` for later */
    /* state */
    Buf cands, heap, row_pool, st_pool, tok_pool, ev_key, ev_prior;
    Buf children, scratch_rows, scratch_st, gathered_rows, gathered_st;
    Buf out_tok, out_parent, out_prob, out_kinds, out_ev_off, out_ev_key, out_ev_prior;
    Buf touches;  /* int: (table, where, leader[leader_len]) per native query, in query order */
    long seq;
} Builder;

static int cand_less(const Cand *a, const Cand *b) {     /* a pops before b */
    return a->p > b->p || (a->p == b->p && a->seq < b->seq);
}

static int heap_push(Builder *B, int ci) {
    if (buf_reserve(&B->heap, 1) < 0) return -1;
    int *h = (int *)B->heap.data;
    Cand *c = (Cand *)B->cands.data;
    Py_ssize_t i = B->heap.len++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!cand_less(&c[ci], &c[h[up]])) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = ci;
    return 0;
}

static int heap_pop(Builder *B) {
    int *h = (int *)B->heap.data;
    Cand *c = (Cand *)B->cands.data;
    int top = h[0];
    int last = h[--B->heap.len];
    Py_ssize_t n = B->heap.len, i = 0;
    while (1) {
        Py_ssize_t l = 2 * i + 1, r = l + 1, best = i;
        int bi = last;
        if (l < n && cand_less(&c[h[l]], &c[bi])) { best = l; bi = h[l]; }
        if (r < n && cand_less(&c[h[r]], &c[bi])) { best = r; bi = h[r]; }
        if (best == i) break;
        h[i] = h[best];
        i = best;
    }
    if (n > 0) h[i] = last;
    return top;
}

static double estimate(const Builder *B, int key, double prior) {
    double t = B->trials[key];
    if (t == 0.0) return prior;
    double e = B->acc[key] / t;
    return e > 1.0 ? 1.0 : (e < 1e-4 ? 1e-4 : e);
}

static int row_token(const Builder *B, int r, int depth) {
    int kind = r < B->nrows[0] ? 0 : 1;
    Py_ssize_t i = kind ? r - B->nrows[0] : r;
    if (depth >= B->width[kind]) return -1;
    return B->rows[kind][i * B->width[kind] + depth];
}

static int find_child(Builder *B, int tok) {
    Child *ch = (Child *)B->children.data;
    for (Py_ssize_t i = 0; i < B->children.len; i++)
        if (ch[i].tok == tok) return (int)i;
    if (buf_reserve(&B->children, 1) < 0) return -1;
    ch = (Child *)B->children.data;
    Child *c = &ch[B->children.len];
    c->tok = tok; c->kinds = 0; c->rank = 99; c->count = 0; c->here[0] = c->here[1] = 0;
    c->rows_off = c->rows_len = c->st_off = c->st_len = 0;
    return (int)B->children.len++;
}

/* Per-expansion scratch: rows and states are appended as (child, value) pairs, then gathered. */
typedef struct { int child, value; } RowPair;
typedef struct { int child; State st; } StPair;

/* The leader for a table query at ``node``: the last leader_len tokens of context + path. */
static int leader_at(Builder *B, int node, int *out) {
    int L = B->leader_len, got = 0;
    int tmp[MAX_LEADER];
    while (got < L && node >= 0) {
        tmp[got++] = AT(B->out_tok, int, node);
        node = AT(B->out_parent, int, node);
    }
    for (int i = B->context_len - 1; got < L && i >= 0; i--) tmp[got++] = B->context_tail[i];
    if (got < L) return 0;
    for (int i = 0; i < L; i++) out[i] = tmp[L - 1 - i];
    return 1;
}

/* The native LRU table's and the store kernels' C APIs (store._lru, store._kernels), when those extensions are
 * built: their own declarations. */
#include "../../store/_lru_api.h"
#include "../../store/_kernels_api.h"
static LRUTableCAPI *lru_api;
static KernelsCAPI *kernels_api;
static PyObject *query_name;

static int query_table(Builder *B, int t, const int *leader, PyObject **result) {
    PyObject *lead = PyTuple_New(B->leader_len);
    if (!lead) return -1;
    for (int i = 0; i < B->leader_len; i++) PyTuple_SET_ITEM(lead, i, PyLong_FromLong(leader[i]));
    PyObject *limit = PyLong_FromLong(B->table_branch[t]);
    if (!limit) { Py_DECREF(lead); return -1; }
    PyObject *argv[3] = {B->tables[t], lead, limit};
    *result = PyObject_VectorcallMethod(query_name, argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(lead);
    Py_DECREF(limit);
    return *result ? 0 : -1;
}

static int add_table_child(Builder *B, int t, int kind, int rank, long count, int off, int fl) {
    int ci = find_child(B, AT(B->tok_pool, int, off));
    if (ci < 0 || buf_reserve(&B->scratch_st, 1) < 0) return -1;
    Child *c = &AT(B->children, Child, ci);
    c->kinds |= 1 << kind;
    if (rank < c->rank) { c->rank = rank; c->count = count; }
    AT(B->scratch_st, StPair, B->scratch_st.len++) = (StPair){ci, (State){t, off, fl, 0}};
    return 0;
}

/* Fast path for the native LRU table: followers written straight into the token pool. */
static int query_native(Builder *B, int t, int kind, const int *leader) {
    int64_t counts[256];
    int limit = B->table_branch[t] < 256 ? B->table_branch[t] : 256;
    if (buf_reserve(&B->tok_pool, (Py_ssize_t)limit * 8) < 0) return -1;
    int fl = 0;
    int base = (int)B->tok_pool.len, k;
    if (B->defer) {
        uint32_t where;
        k = lru_api->peek(B->tables[t], leader, limit, &AT(B->tok_pool, int, base), counts, &fl, &where);
        if (where != LRU_API_NIL) {
            if (buf_reserve(&B->touches, 2 + B->leader_len) < 0) return -1;
            int *rec = &AT(B->touches, int, B->touches.len);
            rec[0] = t;
            memcpy(rec + 1, &where, sizeof where);
            memcpy(rec + 2, leader, sizeof(int) * (size_t)B->leader_len);
            B->touches.len += 2 + B->leader_len;
        }
    } else {
        k = lru_api->query(B->tables[t], leader, limit, &AT(B->tok_pool, int, base), counts, &fl);
    }
    B->tok_pool.len += (Py_ssize_t)k * fl;
    for (int rank = 0; rank < k; rank++)
        if (add_table_child(B, t, kind, rank, (long)counts[rank], base + rank * fl, fl) < 0) return -1;
    return 0;
}

static int expand(Builder *B, int parent, double pprob, int depth, int c_rows_off, int c_rows_len,
                  int c_st_off, int c_st_len) {
    B->children.len = 0;
    B->scratch_rows.len = 0;
    B->scratch_st.len = 0;
    int *row_pool = (int *)B->row_pool.data;
    int n = c_rows_len;
    for (int i = 0; i < n; i++) {
        int r = row_pool[c_rows_off + i];
        int tok = row_token(B, r, depth);
        if (tok < 0) continue;
        int ci = find_child(B, tok);
        if (ci < 0 || buf_reserve(&B->scratch_rows, 1) < 0) return -1;
        int rk = r < B->nrows[0] ? 0 : 1;
        AT(B->children, Child, ci).kinds |= 1 << rk;
        AT(B->children, Child, ci).here[rk]++;
        AT(B->scratch_rows, RowPair, B->scratch_rows.len++) = (RowPair){ci, r};
    }
    int progressing = 0;
    for (int i = 0; i < c_st_len; i++) {
        State st = AT(B->st_pool, State, c_st_off + i);
        if (st.j + 1 >= st.fol_len) continue;
        int kind = B->table_kind[st.table];
        progressing |= 1 << kind;
        int tok = AT(B->tok_pool, int, st.fol_off + st.j + 1);
        int ci = find_child(B, tok);
        if (ci < 0 || buf_reserve(&B->scratch_st, 1) < 0) return -1;
        AT(B->children, Child, ci).kinds |= 1 << kind;
        st.j += 1;
        AT(B->scratch_st, StPair, B->scratch_st.len++) = (StPair){ci, st};
    }
    int leader[MAX_LEADER];
    if (B->ntables && leader_at(B, parent, leader)) {
        for (int t = 0; t < B->ntables; t++) {
            int kind = B->table_kind[t];
            if (progressing >> kind & 1) continue;
            if (lru_api && Py_TYPE(B->tables[t]) == lru_api->type && lru_api->leader_len(B->tables[t]) == B->leader_len) {
                if (query_native(B, t, kind, leader) < 0) return -1;
                continue;
            }
            PyObject *res;
            if (query_table(B, t, leader, &res) < 0) return -1;
            PyObject *seq = PySequence_Fast(res, "table query must return a sequence");
            Py_DECREF(res);
            if (!seq) return -1;
            Py_ssize_t nf = PySequence_Fast_GET_SIZE(seq);
            for (Py_ssize_t rank = 0; rank < nf; rank++) {
                PyObject *item = PySequence_Fast_GET_ITEM(seq, rank);
                PyObject *fol, *cnt;
                if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
                    PyErr_SetString(PyExc_TypeError, "table query items must be (follower, count)");
                    Py_DECREF(seq);
                    return -1;
                }
                fol = PyTuple_GET_ITEM(item, 0);
                cnt = PyTuple_GET_ITEM(item, 1);
                Py_ssize_t fl = PyTuple_Check(fol) ? PyTuple_GET_SIZE(fol) : -1;
                if (fl < 1) { PyErr_SetString(PyExc_TypeError, "follower must be a non-empty tuple"); Py_DECREF(seq); return -1; }
                long count = PyLong_AsLong(cnt);
                if (buf_reserve(&B->tok_pool, fl) < 0) { Py_DECREF(seq); return -1; }
                int off = (int)B->tok_pool.len;
                for (Py_ssize_t k = 0; k < fl; k++)
                    AT(B->tok_pool, int, off + k) = (int)PyLong_AsLong(PyTuple_GET_ITEM(fol, k));
                if (PyErr_Occurred()) { Py_DECREF(seq); return -1; }
                B->tok_pool.len += fl;
                if (add_table_child(B, t, kind, (int)rank, count, off, (int)fl) < 0) { Py_DECREF(seq); return -1; }
            }
            Py_DECREF(seq);
        }
    }
    /* Gather each child's rows and states (scratch order keeps the Python insertion order). */
    Py_ssize_t nch = B->children.len;
    Child *ch = (Child *)B->children.data;
    for (Py_ssize_t i = 0; i < B->scratch_rows.len; i++) ch[AT(B->scratch_rows, RowPair, i).child].rows_len++;
    for (Py_ssize_t i = 0; i < B->scratch_st.len; i++) ch[AT(B->scratch_st, StPair, i).child].st_len++;
    /* Counting sort of rows and states by child, keeping their order within each child. */
    B->gathered_rows.len = 0;
    B->gathered_st.len = 0;
    if (buf_reserve(&B->gathered_rows, B->scratch_rows.len) < 0 || buf_reserve(&B->gathered_st, B->scratch_st.len) < 0)
        return -1;
    {
        int ro = 0, so = 0;
        for (Py_ssize_t i = 0; i < nch; i++) {
            ch[i].rows_off = ro; ro += ch[i].rows_len; ch[i].rows_len = 0;
            ch[i].st_off = so; so += ch[i].st_len; ch[i].st_len = 0;
        }
        for (Py_ssize_t i = 0; i < B->scratch_rows.len; i++) {
            RowPair rp = AT(B->scratch_rows, RowPair, i);
            AT(B->gathered_rows, int, ch[rp.child].rows_off + ch[rp.child].rows_len++) = rp.value;
        }
        for (Py_ssize_t i = 0; i < B->scratch_st.len; i++) {
            StPair sp = AT(B->scratch_st, StPair, i);
            AT(B->gathered_st, State, ch[sp.child].st_off + ch[sp.child].st_len++) = sp.st;
        }
    }
    /* Branch limit: stable sort by evidence count, keep the first ``branch``. */
    int order[512];
    int norder = nch < 512 ? (int)nch : 512;
    for (int i = 0; i < norder; i++) order[i] = i;
    if (nch > B->branch) {
        for (int i = 1; i < norder; i++) {
            int v = order[i], w = ch[v].rows_len + ch[v].st_len, j = i - 1;
            while (j >= 0 && ch[order[j]].rows_len + ch[order[j]].st_len < w) { order[j + 1] = order[j]; j--; }
            order[j + 1] = v;
        }
        norder = B->branch;
    }
    int at_node[2] = {0, 0};
    for (int i = 0; i < n; i++) at_node[row_pool[c_rows_off + i] < B->nrows[0] ? 0 : 1]++;
    int present = 0;  /* source kinds proposing any kept child here */
    for (int oi = 0; oi < norder; oi++) present |= ch[order[oi]].kinds;
    for (int oi = 0; oi < norder; oi++) {
        int ci = order[oi];
        Child c = ch[ci];
        /* Contested: another source kind proposes a different token here. */
        int contested_off = (present & ~c.kinds) ? CONTESTED_BASE : 0;
        int keys[4];
        double priors[4];
        int nev = 0;
        double best = 0.0;
        if (c.rows_len) {
            for (int kind = 0; kind < 2; kind++) {
                if (!c.here[kind]) continue;
                double share = (double)c.here[kind] / at_node[kind];
                int m = B->match_len[kind] + depth;
                int key = ROWS_BASE + ((kind * N_MATCH + match_bucket(m)) * N_SHARE + share_bucket(share)) * N_COUNT
                          + count_bucket(at_node[kind]) + contested_off;
                double prior = share * (m / (m + 1.0)) * (at_node[kind] / (at_node[kind] + 0.5));
                keys[nev] = key; priors[nev++] = prior;
                double e = estimate(B, key, prior);
                if (e > best) best = e;
            }
        }
        if (c.st_len) {
            State first = AT(B->gathered_st, State, c.st_off);
            int kind = B->table_kind[first.table], key;
            double prior;
            if (first.j > 0) {
                key = FOLLOWER_BASE + (kind - 2) * 2 + (first.j < 2 ? first.j : 2) - 1;
                prior = FOLLOWER_PRIOR;
            } else {
                key = FRESH_BASE + ((kind - 2) * N_RANK + (c.rank < N_RANK - 1 ? c.rank : N_RANK - 1)) * N_COUNT
                      + count_bucket(c.count);
                prior = table_prior(kind) / (1.0 + c.rank);
            }
            key += contested_off;
            keys[nev] = key; priors[nev++] = prior;
            double e = estimate(B, key, prior);
            if (e > best) best = e;
        }
        if (nev > 1) {
            int key = AGREE_BASE + c.kinds * N_AGREE + (int)(best * (N_AGREE - 1));
            keys[nev] = key; priors[nev++] = best;
            best = estimate(B, key, best);
        }
        double p = pprob * best;
        if (p < B->min_prob) continue;
        /* Copy the child's rows, states and evidence into the pools and push it. */
        if (buf_reserve(&B->row_pool, c.rows_len) < 0 || buf_reserve(&B->st_pool, c.st_len) < 0 ||
            buf_reserve(&B->ev_key, nev) < 0 || buf_reserve(&B->ev_prior, nev) < 0 || buf_reserve(&B->cands, 1) < 0)
            return -1;
        Cand cand = {p, ++B->seq, parent, c.tok, depth + 1, c.kinds,
                     (int)B->row_pool.len, c.rows_len, (int)B->st_pool.len, c.st_len, (int)B->ev_key.len, nev};
        memcpy(&AT(B->row_pool, int, B->row_pool.len), &AT(B->gathered_rows, int, c.rows_off),
               (size_t)c.rows_len * sizeof(int));
        B->row_pool.len += c.rows_len;
        memcpy(&AT(B->st_pool, State, B->st_pool.len), &AT(B->gathered_st, State, c.st_off),
               (size_t)c.st_len * sizeof(State));
        B->st_pool.len += c.st_len;
        for (int i = 0; i < nev; i++) {
            AT(B->ev_key, int, B->ev_key.len++) = keys[i];
            AT(B->ev_prior, double, B->ev_prior.len++) = priors[i];
        }
        AT(B->cands, Cand, B->cands.len) = cand;
        if (heap_push(B, (int)B->cands.len++) < 0) return -1;
        row_pool = (int *)B->row_pool.data;
    }
    return 0;
}

static int get_rows(PyObject *obj, Py_buffer *view, const int **data, Py_ssize_t *n, Py_ssize_t *w) {
    *data = NULL; *n = 0; *w = 0;
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) < 0) return -1;
    if (view->ndim != 2 || view->itemsize != 4 || (view->format && strcmp(view->format, "i") != 0 &&
                                                   strcmp(view->format, "<i") != 0 && strcmp(view->format, "=i") != 0)) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_SetString(PyExc_TypeError, "rows must be a 2-D C-contiguous int32 array");
        return -1;
    }
    *data = (const int *)view->buf;
    *n = view->shape[0];
    *w = view->shape[1];
    return 0;
}

/* The acceptance model's (N_KEYS,) float64 arrays (``writable`` for scoring). */
static int get_model(PyObject *acc_obj, PyObject *trials_obj, Py_buffer *vacc, Py_buffer *vtr, int writable) {
    int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    if (PyObject_GetBuffer(acc_obj, vacc, flags) < 0) return -1;
    if (PyObject_GetBuffer(trials_obj, vtr, flags) < 0) return -1;
    if (vacc->len < (Py_ssize_t)(N_KEYS * sizeof(double)) || vtr->len < (Py_ssize_t)(N_KEYS * sizeof(double))) {
        PyErr_SetString(PyExc_ValueError, "acceptance arrays too short");
        return -1;
    }
    return 0;
}

#define N_BUFS 20

static PyObject *list_from_ints(const int *v, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLong(v[i]));
    return t;
}

static PyObject *tuple_from_doubles(const double *v, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, PyFloat_FromDouble(v[i]));
    return t;
}

static void builder_bufs(Builder *B, Buf **out) {
    Buf *bufs[] = {&B->cands, &B->heap, &B->row_pool, &B->st_pool, &B->tok_pool, &B->ev_key, &B->ev_prior,
                   &B->children, &B->scratch_rows, &B->scratch_st, &B->gathered_rows, &B->gathered_st, &B->out_tok,
                   &B->out_parent, &B->out_prob, &B->out_kinds, &B->out_ev_off, &B->out_ev_key, &B->out_ev_prior,
                   &B->touches};
    for (size_t i = 0; i < N_BUFS; i++) out[i] = bufs[i];
}

static void builder_init(Builder *B) {
    memset(B, 0, sizeof *B);
    Buf init[N_BUFS] = {BUF(Cand), BUF(int), BUF(int), BUF(State), BUF(int), BUF(int), BUF(double), BUF(Child),
                        BUF(RowPair), BUF(StPair), BUF(int), BUF(State), BUF(int), BUF(int), BUF(double), BUF(int),
                        BUF(int), BUF(int), BUF(double), BUF(int)};
    Buf *bufs[N_BUFS];
    builder_bufs(B, bufs);
    for (size_t i = 0; i < N_BUFS; i++) *bufs[i] = init[i];
}

/* Empty every buffer (keeping its memory) for the next tree. */
static void builder_clear(Builder *B) {
    Buf *bufs[N_BUFS];
    builder_bufs(B, bufs);
    for (size_t i = 0; i < N_BUFS; i++) bufs[i]->len = 0;
    B->seq = 0;
}

static void builder_free(Builder *B) {
    Buf *bufs[N_BUFS];
    builder_bufs(B, bufs);
    for (size_t i = 0; i < N_BUFS; i++) buf_free(bufs[i]);
}

/* (kind, table, branch) items into the builder (borrowed references). */
static int parse_tables(Builder *B, PyObject *tables) {
    B->ntables = (int)PySequence_Fast_GET_SIZE(tables);
    if (B->ntables > MAX_TABLES) { PyErr_SetString(PyExc_ValueError, "too many tables"); return -1; }
    for (int t = 0; t < B->ntables; t++) {
        PyObject *item = PySequence_Fast_GET_ITEM(tables, t);
        if (!PyArg_ParseTuple(item, "iOi", &B->table_kind[t], &B->tables[t], &B->table_branch[t])) return -1;
        if (B->table_kind[t] != 2 && B->table_kind[t] != 3) {
            PyErr_SetString(PyExc_ValueError, "table kind must be 2 or 3");
            return -1;
        }
    }
    return 0;
}

/* Grow the tree best-first from the inputs already set; the result is in the out_* buffers. */
static int builder_run(Builder *B) {
    Py_ssize_t total = B->nrows[0] + B->nrows[1];
    if (buf_reserve(&B->row_pool, total) < 0) return -1;
    for (Py_ssize_t i = 0; i < total; i++) AT(B->row_pool, int, i) = (int)i;
    B->row_pool.len = total;
    if (expand(B, -1, 1.0, 0, 0, (int)total, 0, 0) < 0) return -1;
    if (buf_reserve(&B->out_ev_off, 1) < 0) return -1;
    AT(B->out_ev_off, int, B->out_ev_off.len++) = 0;
    while (B->heap.len && B->out_tok.len < B->max_nodes) {
        Cand c = AT(B->cands, Cand, heap_pop(B));
        if (buf_reserve(&B->out_tok, 1) < 0 || buf_reserve(&B->out_parent, 1) < 0 || buf_reserve(&B->out_prob, 1) < 0 ||
            buf_reserve(&B->out_kinds, 1) < 0 || buf_reserve(&B->out_ev_off, 1) < 0 ||
            buf_reserve(&B->out_ev_key, c.ev_len) < 0 || buf_reserve(&B->out_ev_prior, c.ev_len) < 0)
            return -1;
        int node = (int)B->out_tok.len;
        AT(B->out_tok, int, B->out_tok.len++) = c.tok;
        AT(B->out_parent, int, B->out_parent.len++) = c.parent;
        AT(B->out_prob, double, B->out_prob.len++) = c.p;
        int low = 0;
        while (!(c.kinds >> low & 1) && low < 8) low++;
        AT(B->out_kinds, int, B->out_kinds.len++) = low;
        for (int i = 0; i < c.ev_len; i++) {
            AT(B->out_ev_key, int, B->out_ev_key.len++) = AT(B->ev_key, int, c.ev_off + i);
            AT(B->out_ev_prior, double, B->out_ev_prior.len++) = AT(B->ev_prior, double, c.ev_off + i);
        }
        AT(B->out_ev_off, int, B->out_ev_off.len++) = (int)B->out_ev_key.len;
        if (B->out_tok.len >= B->max_nodes) break;
        if (c.depth < B->max_depth &&
            expand(B, node, c.p, c.depth, c.rows_off, c.rows_len, c.st_off, c.st_len) < 0)
            return -1;
    }
    return 0;
}

/* build(context_tail, session_rows, session_match, store_rows, store_match, tables, leader_len,
 *       accepted, trials, max_nodes, max_depth, min_prob, branch)
 * -> (tokens, parents, probs, kinds, ev_offsets, ev_keys, ev_priors) */
static PyObject *build(PyObject *self, PyObject *args) {
    PyObject *ctx_obj, *rows0_obj, *rows1_obj, *tables_obj, *acc_obj, *trials_obj;
    int m0, m1, leader_len, max_nodes, max_depth, branch;
    double min_prob;
    if (!PyArg_ParseTuple(args, "OOiOiOiOOiidi", &ctx_obj, &rows0_obj, &m0, &rows1_obj, &m1, &tables_obj,
                          &leader_len, &acc_obj, &trials_obj, &max_nodes, &max_depth, &min_prob, &branch))
        return NULL;
    if (leader_len < 1 || leader_len > MAX_LEADER) {
        PyErr_SetString(PyExc_ValueError, "leader_len out of range");
        return NULL;
    }
    Builder B;
    builder_init(&B);
    Py_buffer v0 = {0}, v1 = {0}, vacc = {0}, vtr = {0};
    PyObject *result = NULL, *tables = NULL;
    int ctx_tmp[MAX_LEADER];
    if (get_rows(rows0_obj, &v0, &B.rows[0], &B.nrows[0], &B.width[0]) < 0) goto done;
    if (get_rows(rows1_obj, &v1, &B.rows[1], &B.nrows[1], &B.width[1]) < 0) goto done;
    if (get_model(acc_obj, trials_obj, &vacc, &vtr, 0) < 0) goto done;
    B.acc = (const double *)vacc.buf;
    B.trials = (const double *)vtr.buf;
    tables = PySequence_Fast(tables_obj, "tables must be a sequence of (kind, table, branch)");
    if (!tables || parse_tables(&B, tables) < 0) goto done;
    {
        PyObject *ctx = PySequence_Fast(ctx_obj, "context must be a sequence");
        if (!ctx) goto done;
        Py_ssize_t cn = PySequence_Fast_GET_SIZE(ctx);
        Py_ssize_t start = cn > leader_len ? cn - leader_len : 0;
        for (Py_ssize_t i = start; i < cn; i++) ctx_tmp[i - start] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(ctx, i));
        Py_DECREF(ctx);
        if (PyErr_Occurred()) goto done;
        B.context_tail = ctx_tmp;
        B.context_len = (int)(cn - start);
    }
    B.match_len[0] = m0; B.match_len[1] = m1;
    B.leader_len = leader_len; B.max_nodes = max_nodes; B.max_depth = max_depth;
    B.min_prob = min_prob; B.branch = branch;
    if (builder_run(&B) < 0) goto done;
    result = Py_BuildValue("(NNNNNNN)", list_from_ints((int *)B.out_tok.data, B.out_tok.len),
                           list_from_ints((int *)B.out_parent.data, B.out_parent.len),
                           tuple_from_doubles((double *)B.out_prob.data, B.out_prob.len),
                           list_from_ints((int *)B.out_kinds.data, B.out_kinds.len),
                           list_from_ints((int *)B.out_ev_off.data, B.out_ev_off.len),
                           list_from_ints((int *)B.out_ev_key.data, B.out_ev_key.len),
                           tuple_from_doubles((double *)B.out_ev_prior.data, B.out_ev_prior.len));
done:
    builder_free(&B);
    if (v0.obj) PyBuffer_Release(&v0);
    if (v1.obj) PyBuffer_Release(&v1);
    if (vacc.obj) PyBuffer_Release(&vacc);
    if (vtr.obj) PyBuffer_Release(&vtr);
    Py_XDECREF(tables);
    return result;
}

static int long_at(PyObject *seq, Py_ssize_t i, long *out) {
    *out = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* score(tokens, parents, offsets, keys, priors, accepted, acc, trials, strength, horizon) -> confirmed
 * Same as tree_builder.score_draft: every child of the root and of each confirmed node was tested. */
static PyObject *score(PyObject *self, PyObject *args) {
    PyObject *tok_o, *par_o, *off_o, *key_o, *pri_o, *accd_o, *acc_o, *tr_o;
    double strength, horizon;
    if (!PyArg_ParseTuple(args, "OOOOOOOOdd", &tok_o, &par_o, &off_o, &key_o, &pri_o, &accd_o, &acc_o, &tr_o,
                          &strength, &horizon))
        return NULL;
    PyObject *toks = NULL, *pars = NULL, *offs = NULL, *keys = NULL, *pris = NULL, *accd = NULL, *result = NULL;
    Py_buffer va = {0}, vt = {0};
    toks = PySequence_Fast(tok_o, "tokens"); pars = PySequence_Fast(par_o, "parents");
    offs = PySequence_Fast(off_o, "offsets"); keys = PySequence_Fast(key_o, "keys");
    pris = PySequence_Fast(pri_o, "priors"); accd = PySequence_Fast(accd_o, "accepted");
    if (!toks || !pars || !offs || !keys || !pris || !accd) goto done;
    if (PyObject_GetBuffer(acc_o, &va, PyBUF_WRITABLE) < 0 || PyObject_GetBuffer(tr_o, &vt, PyBUF_WRITABLE) < 0)
        goto done;
    double *acc = (double *)va.buf, *trials = (double *)vt.buf;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(toks), na = PySequence_Fast_GET_SIZE(accd);
    if (PySequence_Fast_GET_SIZE(pars) != n || PySequence_Fast_GET_SIZE(offs) != n + 1) {
        PyErr_SetString(PyExc_ValueError, "tree arrays of different lengths");
        goto done;
    }
    long node = -1, confirmed = 0;
    while (confirmed < na) {
        long want, next = -2, tested = 0;
        if (long_at(accd, confirmed, &want) < 0) goto done;
        for (Py_ssize_t i = 0; i < n; i++) {
            long par, tok, lo, hi;
            if (long_at(pars, i, &par) < 0) goto done;
            if (par != node) continue;
            if (long_at(toks, i, &tok) < 0 || long_at(offs, i, &lo) < 0 || long_at(offs, i + 1, &hi) < 0) goto done;
            tested++;
            int hit = tok == want;
            if (hit) next = (long)i;
            for (long e = lo; e < hi; e++) {
                long key;
                if (long_at(keys, e, &key) < 0) goto done;
                if (key < 0 || key >= N_KEYS) { PyErr_SetString(PyExc_ValueError, "evidence key out of range"); goto done; }
                double prior = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(pris, e));
                if (prior == -1.0 && PyErr_Occurred()) goto done;
                if (trials[key] == 0.0) { acc[key] = prior * strength; trials[key] = strength; }
                acc[key] += hit ? 1.0 : 0.0;
                trials[key] += 1.0;
                if (trials[key] > horizon) { acc[key] *= 0.5; trials[key] *= 0.5; }
            }
        }
        if (!tested || next < 0) break;
        node = next;
        confirmed++;
    }
    result = PyLong_FromLong(confirmed);
done:
    if (va.obj) PyBuffer_Release(&va);
    if (vt.obj) PyBuffer_Release(&vt);
    Py_XDECREF(toks); Py_XDECREF(pars); Py_XDECREF(offs); Py_XDECREF(keys); Py_XDECREF(pris); Py_XDECREF(accd);
    return result;
}

/* ---- packed drafts: a tree and its evidence in one bytes object --------------------------------
 * int32 n, nev; int32 tokens[n], parents[n], kinds[n], ev_offsets[n + 1], keys[nev]; float64 priors[nev]. */

typedef struct {
    int n, nev;
    const char *tokens, *parents, *kinds, *offsets, *keys, *priors;  /* unaligned: read with memcpy */
} Packed;

static int ld_int(const char *base, Py_ssize_t i) { int v; memcpy(&v, base + 4 * i, 4); return v; }
static double ld_double(const char *base, Py_ssize_t i) { double v; memcpy(&v, base + 8 * i, 8); return v; }

/* A packed draft: bytes, or the bytearray the batched step keeps rewriting for its session. */
static int packed_view(PyObject *obj, Packed *p) {
    int array = PyByteArray_Check(obj);
    if ((!array && !PyBytes_Check(obj)) || (array ? PyByteArray_GET_SIZE(obj) : PyBytes_GET_SIZE(obj)) < 8) {
        PyErr_SetString(PyExc_TypeError, "a packed draft must be bytes or a bytearray");
        return -1;
    }
    const char *d = array ? PyByteArray_AS_STRING(obj) : PyBytes_AS_STRING(obj);
    Py_ssize_t size = array ? PyByteArray_GET_SIZE(obj) : PyBytes_GET_SIZE(obj);
    p->n = ld_int(d, 0);
    p->nev = ld_int(d, 1);
    Py_ssize_t need = 8 + 4 * ((Py_ssize_t)p->n * 4 + 1 + p->nev) + 8 * (Py_ssize_t)p->nev;
    if (p->n < 0 || p->nev < 0 || size != need) {
        PyErr_SetString(PyExc_ValueError, "malformed packed draft");
        return -1;
    }
    p->tokens = d + 8;
    p->parents = p->tokens + 4 * (Py_ssize_t)p->n;
    p->kinds = p->parents + 4 * (Py_ssize_t)p->n;
    p->offsets = p->kinds + 4 * (Py_ssize_t)p->n;
    p->keys = p->offsets + 4 * ((Py_ssize_t)p->n + 1);
    p->priors = p->keys + 4 * (Py_ssize_t)p->nev;
    return 0;
}

/* Bytes of the builder's last tree as a packed draft. */
static Py_ssize_t packed_size(const Builder *B) {
    Py_ssize_t n = B->out_tok.len, nev = B->out_ev_key.len;
    return 8 + 4 * (n * 4 + 1 + nev) + 8 * nev;
}

/* The builder's last tree as a packed draft into d (packed_size bytes). */
static void pack_into(const Builder *B, char *d) {
    Py_ssize_t n = B->out_tok.len, nev = B->out_ev_key.len;
    int head[2] = {(int)n, (int)nev};
    memcpy(d, head, 8);
    d += 8;
    memcpy(d, B->out_tok.data, 4 * n); d += 4 * n;
    memcpy(d, B->out_parent.data, 4 * n); d += 4 * n;
    memcpy(d, B->out_kinds.data, 4 * n); d += 4 * n;
    memcpy(d, B->out_ev_off.data, 4 * (n + 1)); d += 4 * (n + 1);
    memcpy(d, B->out_ev_key.data, 4 * nev); d += 4 * nev;
    memcpy(d, B->out_ev_prior.data, 8 * nev);
}

/* pack(tokens, parents, kinds, ev_offsets, ev_keys, ev_priors) -> a packed draft of a tree built earlier */
static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5])) return NULL;
    PyObject *seqs[6] = {NULL, NULL, NULL, NULL, NULL, NULL}, *result = NULL;
    for (int i = 0; i < 6; i++)
        if (!(seqs[i] = PySequence_Fast(objs[i], "pack takes sequences"))) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seqs[0]), nev = PySequence_Fast_GET_SIZE(seqs[4]);
    if (PySequence_Fast_GET_SIZE(seqs[1]) != n || PySequence_Fast_GET_SIZE(seqs[2]) != n ||
        PySequence_Fast_GET_SIZE(seqs[3]) != n + 1 || PySequence_Fast_GET_SIZE(seqs[5]) != nev) {
        PyErr_SetString(PyExc_ValueError, "tree arrays of different lengths");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, 8 + 4 * (n * 4 + 1 + nev) + 8 * nev);
    if (!result) goto done;
    char *d = PyBytes_AS_STRING(result);
    int head[2] = {(int)n, (int)nev};
    memcpy(d, head, 8);
    d += 8;
    for (int a = 0; a < 5; a++) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(seqs[a]);
        for (Py_ssize_t i = 0; i < len; i++, d += 4) {
            int v = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(seqs[a], i));
            memcpy(d, &v, 4);
        }
    }
    for (Py_ssize_t i = 0; i < nev; i++, d += 8) {
        double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seqs[5], i));
        memcpy(d, &v, 8);
    }
    if (PyErr_Occurred()) Py_CLEAR(result);
done:
    for (int i = 0; i < 6; i++) Py_XDECREF(seqs[i]);
    return result;
}

/* score() over a packed draft: the confirmed path's node kinds into kinds_out (room for min(na, n)).
 * Returns the draft tokens confirmed, or -1 on a malformed key. */
static long score_core(const Packed *p, const int *accepted, Py_ssize_t na, double *acc, double *trials,
                       double strength, double horizon, int *kinds_out) {
    long node = -1, confirmed = 0;
    while (confirmed < na) {
        int want = accepted[confirmed];
        long next = -2, tested = 0;
        for (int i = 0; i < p->n; i++) {
            if (ld_int(p->parents, i) != node) continue;
            tested++;
            int hit = ld_int(p->tokens, i) == want;
            if (hit) next = i;
            for (int e = ld_int(p->offsets, i), hi = ld_int(p->offsets, i + 1); e < hi; e++) {
                int key = ld_int(p->keys, e);
                if (key < 0 || key >= N_KEYS) { PyErr_SetString(PyExc_ValueError, "evidence key out of range"); return -1; }
                if (trials[key] == 0.0) { acc[key] = ld_double(p->priors, e) * strength; trials[key] = strength; }
                acc[key] += hit ? 1.0 : 0.0;
                trials[key] += 1.0;
                if (trials[key] > horizon) { acc[key] *= 0.5; trials[key] *= 0.5; }
            }
        }
        if (!tested || next < 0) break;
        kinds_out[confirmed] = ld_int(p->kinds, next);
        node = next;
        confirmed++;
    }
    return confirmed;
}

/* score_packed(packed, accepted, acc, trials, strength, horizon) -> (confirmed, nodes, kinds of the confirmed) */
static PyObject *score_packed(PyObject *self, PyObject *args) {
    PyObject *packed_o, *acc_o, *tr_o, *accd_o;
    double strength, horizon;
    if (!PyArg_ParseTuple(args, "OOOOdd", &packed_o, &accd_o, &acc_o, &tr_o, &strength, &horizon)) return NULL;
    Packed p;
    if (packed_view(packed_o, &p) < 0) return NULL;
    PyObject *accd = PySequence_Fast(accd_o, "accepted must be a sequence"), *result = NULL;
    if (!accd) return NULL;
    Py_buffer va = {0}, vt = {0};
    Py_ssize_t na = PySequence_Fast_GET_SIZE(accd);
    int *toks = PyMem_Malloc(sizeof(int) * (size_t)(2 * na + 1)), *kinds = toks + na;
    if (!toks) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < na; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(accd, i));
        if (v == -1 && PyErr_Occurred()) goto done;
        toks[i] = (int)v;
    }
    if (get_model(acc_o, tr_o, &va, &vt, 1) < 0) goto done;
    long confirmed = score_core(&p, toks, na, (double *)va.buf, (double *)vt.buf, strength, horizon, kinds);
    if (confirmed < 0) goto done;
    result = Py_BuildValue("(liN)", confirmed, p.n, list_from_ints(kinds, confirmed));
done:
    if (va.obj) PyBuffer_Release(&va);
    if (vt.obj) PyBuffer_Release(&vt);
    PyMem_Free(toks);
    Py_DECREF(accd);
    return result;
}

/* ---- one engine step of many sessions ------------------------------------------------------------ */

static PyObject *update_name;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A suffix match of a session: (match_len, rows) from lookup(...) -> None | (m, counts, rows) | NotImplemented,
 * or from fallback(kind, tokens[:n]) -> Continuations when the native lookup declines. *rows_out is a new
 * reference (NULL: no match). */
static int match_rows(PyObject *lookup, PyObject *const *args, size_t nargs, PyObject *fallback, int kind,
                      PyObject *tokens, long *m_out, PyObject **rows_out) {
    *m_out = 0;
    *rows_out = NULL;
    PyObject *found = lookup ? PyObject_Vectorcall(lookup, args, nargs, NULL) : Py_NewRef(Py_NotImplemented);
    if (!found) return -1;
    if (found == Py_NotImplemented) {
        Py_DECREF(found);
        found = PyObject_CallFunction(fallback, "iO", kind, tokens);
        if (!found) return -1;
        PyObject *m = PyObject_GetAttrString(found, "match_len"), *rows = PyObject_GetAttrString(found, "rows");
        Py_DECREF(found);
        if (!m || !rows) { Py_XDECREF(m); Py_XDECREF(rows); return -1; }
        *m_out = PyLong_AsLong(m);
        Py_DECREF(m);
        if (*m_out == -1 && PyErr_Occurred()) { Py_DECREF(rows); return -1; }
        if (*m_out) *rows_out = rows; else Py_DECREF(rows);
        return 0;
    }
    if (found == Py_None) { Py_DECREF(found); return 0; }
    if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 3) {
        Py_DECREF(found);
        PyErr_SetString(PyExc_TypeError, "a lookup must return (match_len, counts, rows)");
        return -1;
    }
    *m_out = PyLong_AsLong(PyTuple_GET_ITEM(found, 0));
    if (*m_out == -1 && PyErr_Occurred()) { Py_DECREF(found); return -1; }
    if (*m_out) *rows_out = Py_NewRef(PyTuple_GET_ITEM(found, 2));
    Py_DECREF(found);
    return 0;
}

static long list_long(PyObject *list, Py_ssize_t i) { return PyLong_AsLong(PyList_GET_ITEM(list, i)); }

/* What every session of a batched step reads of the store, and which lookups go straight through the store
 * kernels' C API (the caller passed their native Python functions; else each goes through Python). */
typedef struct {
    int session, store;
    Py_buffer ring;                    /* the store's ring buffer slots, int32 */
    int64_t oldest, end, candidates, examined;
    PyObject *delta, *main_ix, *tail;  /* borrowed from the store arguments */
} StoreView;

static void store_view_free(StoreView *v) {
    if (v->ring.obj) PyBuffer_Release(&v->ring);
    memset(v, 0, sizeof(*v));
}

static void store_view(StoreView *v, PyObject *session_fn, PyObject *store_fn, PyObject *store_args) {
    memset(v, 0, sizeof(*v));
    if (!kernels_api) return;
    v->session = session_fn != NULL;
    if (!store_fn) return;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(store_args, 0), &v->ring, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) < 0) {
        PyErr_Clear();
        v->ring.obj = NULL;
        return;
    }
    if (v->ring.ndim != 1 || v->ring.itemsize != 4 || v->ring.len < 4 ||
        (v->ring.format && strcmp(v->ring.format, "i") && strcmp(v->ring.format, "<i") && strcmp(v->ring.format, "=i")))
        return;
    v->oldest = PyLong_AsLongLong(PyTuple_GET_ITEM(store_args, 1));
    v->end = PyLong_AsLongLong(PyTuple_GET_ITEM(store_args, 2));
    v->candidates = PyLong_AsLongLong(PyTuple_GET_ITEM(store_args, 5));
    v->examined = PyLong_AsLongLong(PyTuple_GET_ITEM(store_args, 6));
    if (PyErr_Occurred()) {  /* not plain ints: the Python lookup decides */
        PyErr_Clear();
        return;
    }
    v->store = 1;
    v->delta = PyTuple_GET_ITEM(store_args, 3);
    v->main_ix = PyTuple_GET_ITEM(store_args, 4);
    v->tail = PyTuple_GET_ITEM(store_args, 7);
}

/* One thread's working memory for drafting sessions: its lookups (the session's and the store's answers stay
 * apart), its tree builder, and the trees it drafted in this step (keep_tree). */
typedef struct {
    Lookup *lookup[2];
    Builder B;
    Buf kept;
    int ready;
} Worker;

static int worker_ready(Worker *w) {
    if (w->ready) return 0;
    builder_init(&w->B);
    w->kept = (Buf)BUF(char);
    w->ready = 1;
    for (int i = 0; i < 2 && kernels_api; i++)
        if (!(w->lookup[i] = kernels_api->lookup_new())) return -1;
    return 0;
}

static void worker_free(Worker *w) {
    if (!w->ready) return;
    for (int i = 0; i < 2; i++)
        if (w->lookup[i]) kernels_api->lookup_free(w->lookup[i]);
    builder_free(&w->B);
    buf_free(&w->kept);
    memset(w, 0, sizeof(*w));
}

/* Every thread's worker, kept from step to step. ``pool_busy``: a step is using them (a step begun meanwhile, through
 * Python code the first one runs, drafts on a worker of its own). */
static Worker pool[WORKERS_MAX];
static int pool_busy;

/* The table and tree settings every builder of a step shares, from the one that parsed them. */
static void builder_configure(Builder *B, const Builder *from) {
    memcpy(B->tables, from->tables, sizeof B->tables);
    memcpy(B->table_kind, from->table_kind, sizeof B->table_kind);
    memcpy(B->table_branch, from->table_branch, sizeof B->table_branch);
    B->ntables = from->ntables;
    B->leader_len = from->leader_len;
    B->acc = from->acc;
    B->trials = from->trials;
    B->max_depth = from->max_depth;
    B->min_prob = from->min_prob;
    B->branch = from->branch;
    B->defer = 1;
}

/* Whether every table is a native one queried natively (expand's test): a builder then calls no Python. */
static int tables_native(const Builder *B) {
    for (int t = 0; t < B->ntables; t++)
        if (!lru_api || Py_TYPE(B->tables[t]) != lru_api->type || lru_api->leader_len(B->tables[t]) != B->leader_len)
            return 0;
    return 1;
}

/* A drafted tree kept until the step hands it out, in its worker's ``kept``: this head, its packed draft, the
 * nodes' probabilities (float64) and the table refreshes its queries deferred (Builder.touches), one after another
 * (read with memcpy: nothing is aligned). */
typedef struct { Py_ssize_t packed, n, touches; } KeptHead;

/* The builder's tree appended to the worker's kept trees; its offset there, or -1 out of memory. */
static Py_ssize_t keep_tree(Worker *w) {
    const Builder *B = &w->B;
    KeptHead h = {packed_size(B), B->out_tok.len, B->touches.len};
    Py_ssize_t size = (Py_ssize_t)sizeof h + h.packed + 8 * h.n + (Py_ssize_t)sizeof(int) * h.touches;
    if (buf_reserve(&w->kept, size) < 0) return -1;
    Py_ssize_t at = w->kept.len;
    char *d = (char *)w->kept.data + at;
    memcpy(d, &h, sizeof h);
    pack_into(B, d + sizeof h);
    memcpy(d + sizeof h + h.packed, B->out_prob.data, 8 * (size_t)h.n);
    if (h.touches) memcpy(d + sizeof h + h.packed + 8 * h.n, B->touches.data, sizeof(int) * (size_t)h.touches);
    w->kept.len += size;
    return at;
}

enum { JOB_IDLE, JOB_DRAFT, JOB_PYTHON, JOB_DONE };

/* One session of a batched step. */
typedef struct {
    PyObject *sess;   /* the DraftSession (borrowed from the caller's list) */
    PyObject *last;   /* its last packed draft (a new reference; None when it has none) */
    int adaptive;     /* its budget adapts (else the batch sees FULL_BUDGET_EMA and its own average goes on) */
    Py_buffer vb;     /* the session's tokens (int32), held for the whole step */
    long n, budget, confirmed, scored;
    int appended;     /* tokens were appended: its last draft is spent */
    int state;        /* JOB_IDLE: nothing to draft; JOB_DRAFT: to draft; JOB_PYTHON: a lookup must go through
                       * Python; JOB_DONE: drafted */
    double ema;
    int64_t ns;       /* time spent on it */
    int kept_by;      /* JOB_DONE with nodes: the worker that keeps its tree, at kept_at (else -1) */
    Py_ssize_t kept_at;
} Job;

typedef struct {
    StoreView view;
    int use_session, use_store, max_match, max_occ, max_depth, ctx_len;  /* ctx_len: context tokens a leader takes */
    PyObject *session_fn, *store_fn, *store_args, *fallback, *m_o, *occ_o, *dep_o;
    Job *jobs;
    Py_ssize_t njobs;
    Worker *workers;
    Py_ssize_t next;  /* the next job a worker takes (atomic) */
    int failed;       /* a worker ran out of memory (atomic) */
} StepCtx;

/* Drafts job j on worker wi: the session's and the store's lookups, then its tree, kept by the worker. ``python``: the
 * GIL is held, and lookups the native kernels decline go through the Python functions the caller passed; else
 * such a job is left JOB_PYTHON for the calling thread, and nothing here touches Python. 0, or -1 on error (raised
 * when python; else out of memory, which the step raises). */
static int job_draft(int wi, const StepCtx *sc, Job *j, int python) {
    int64_t t0 = now_ns();
    Worker *w = &sc->workers[wi];
    const int *tok = (const int *)j->vb.buf;
    Py_ssize_t cap = j->vb.len / 4;
    long n = j->n;
    PyObject *rows_o[2] = {NULL, NULL}, *view = NULL, *n_o = NULL;
    long ml[2] = {0, 0};
    Py_buffer vr[2] = {{0}, {0}};
    LookupResult found[2] = {{0}, {0}};
    int ok = 1;
    /* No node of a tree of ``budget`` nodes lies deeper than that: longer rows would go unread. */
    int reach = j->budget < sc->max_depth ? (int)j->budget : sc->max_depth;
    const StoreView *v = &sc->view;
    for (int kind = 0; ok && kind < 2; kind++) {
        if (!(kind ? sc->use_store : sc->use_session)) continue;
        int rc = 1;
        if (kind == 0 && v->session)
            rc = kernels_api->session_lookup_shared(w->lookup[0], tok, cap, n, sc->max_match, sc->max_occ, reach,
                                                    &found[0]);
        else if (kind == 1 && v->store)
            rc = kernels_api->store_lookup_shared(w->lookup[1], tok, n, (const int *)v->ring.buf, v->ring.len / 4,
                                                  v->oldest, v->end, v->delta, v->main_ix, v->tail, sc->max_match,
                                                  sc->max_occ, reach, v->candidates, v->examined, &found[1]);
        if (rc < 0) {
            if (python && !PyErr_Occurred()) PyErr_NoMemory();
            ok = 0;
        } else if (rc == 0) {
            ml[kind] = (long)found[kind].m;
        } else if (!python) {
            j->state = JOB_PYTHON;
            return 0;
        } else {  /* through the Python lookup the caller passed (or the fallback it declines to) */
            PyObject *buf = j->vb.obj;
            if (!view && (!(view = PySequence_GetSlice(buf, 0, n)) || !(n_o = PyLong_FromLong(n)))) {
                ok = 0;
                break;
            }
            if (kind == 0) {
                PyObject *sargs[5] = {buf, n_o, sc->m_o, sc->occ_o, sc->dep_o};
                ok = match_rows(sc->session_fn, sargs, 5, sc->fallback, 0, view, &ml[0], &rows_o[0]) == 0;
            } else {
                PyObject *a = sc->store_args;
                PyObject *sargs[12] = {view, PyTuple_GET_ITEM(a, 0), PyTuple_GET_ITEM(a, 1), PyTuple_GET_ITEM(a, 2),
                                       PyTuple_GET_ITEM(a, 3), PyTuple_GET_ITEM(a, 4), sc->m_o, sc->occ_o,
                                       sc->dep_o, PyTuple_GET_ITEM(a, 5), PyTuple_GET_ITEM(a, 6),
                                       PyTuple_GET_ITEM(a, 7)};
                ok = match_rows(sc->store_fn, sargs, 12, sc->fallback, 1, view, &ml[1], &rows_o[1]) == 0;
            }
        }
    }
    Py_XDECREF(view);
    Py_XDECREF(n_o);
    Builder *B = &w->B;
    builder_clear(B);
    B->rows[0] = B->rows[1] = NULL;
    B->nrows[0] = B->nrows[1] = B->width[0] = B->width[1] = 0;
    for (int kind = 0; ok && kind < 2; kind++) {
        if (rows_o[kind]) {
            if (get_rows(rows_o[kind], &vr[kind], &B->rows[kind], &B->nrows[kind], &B->width[kind]) < 0) ok = 0;
        } else if (found[kind].m) {
            B->rows[kind] = found[kind].rows;
            B->nrows[kind] = found[kind].k;
            B->width[kind] = found[kind].depth;
        }
    }
    int ctx[MAX_LEADER];
    int cl = sc->ctx_len < B->leader_len ? sc->ctx_len : B->leader_len;
    if (cl > n) cl = (int)n;
    for (int i = 0; i < cl; i++) ctx[i] = tok[n - cl + i];
    B->context_tail = ctx;
    B->context_len = cl;
    B->match_len[0] = (int)ml[0];
    B->match_len[1] = (int)ml[1];
    B->max_nodes = (int)j->budget;
    if (ok && builder_run(B) < 0) ok = 0;
    for (int kind = 0; kind < 2; kind++) {
        if (vr[kind].obj) PyBuffer_Release(&vr[kind]);
        Py_XDECREF(rows_o[kind]);
    }
    if (ok && B->out_tok.len) {
        if ((j->kept_at = keep_tree(w)) < 0) ok = 0;
        else j->kept_by = wi;
    }
    if (ok) j->state = JOB_DONE;
    j->ns += now_ns() - t0;
    return ok ? 0 : -1;
}

/* Job j's kept tree (its head into *h), or NULL when it drafted none. */
static const char *kept_tree(const Worker *workers, const Job *j, KeptHead *h) {
    if (j->kept_by < 0) return NULL;
    const char *d = (const char *)workers[j->kept_by].kept.data + j->kept_at;
    memcpy(h, d, sizeof *h);
    return d + sizeof *h;
}

/* Applies the refreshes the step's drafts deferred (Builder.touches), in session order, each leader once, at its last
 * touch: the recency order the queries would have left one after another (a refresh moves a leader to the most
 * recent end), without touching a leader's memory once for every query of it. 0, or -1 out of memory (raised). */
static int apply_touches(const Builder *cfg, const Job *jobs, Py_ssize_t nb, const Worker *workers) {
    Py_ssize_t stride = 2 + cfg->leader_len, total = 0;
    KeptHead h;
    for (Py_ssize_t s = 0; s < nb; s++)
        if (kept_tree(workers, &jobs[s], &h)) total += h.touches / stride;
    if (!total) return 0;
    Py_ssize_t slots = 64;
    while (slots < 2 * total) slots *= 2;
    const char **rec = PyMem_RawMalloc(sizeof(char *) * (size_t)total);
    Py_ssize_t *slot_rec = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)slots);
    char *last = PyMem_RawMalloc((size_t)total);
    if (!rec || !slot_rec || !last) {
        PyMem_RawFree(rec); PyMem_RawFree(slot_rec); PyMem_RawFree(last);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t s = 0; s < nb; s++) {
        const char *pk = kept_tree(workers, &jobs[s], &h);
        if (!pk) continue;
        const char *t = pk + h.packed + 8 * h.n;
        for (Py_ssize_t i = 0; i < h.touches; i += stride) rec[n++] = t + sizeof(int) * i;
    }
    for (Py_ssize_t i = 0; i < slots; i++) slot_rec[i] = -1;
    size_t key_len = sizeof(int) * (size_t)stride;  /* (table, where, leader): a record equal to a later one is not last */
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        uint64_t key;
        memcpy(&key, rec[i], sizeof key);  /* table, where */
        Py_ssize_t at = (Py_ssize_t)((key * 0x9E3779B97F4A7C15ULL) >> 32) & (slots - 1);
        last[i] = 1;
        while (slot_rec[at] >= 0) {
            if (!memcmp(rec[slot_rec[at]], rec[i], key_len)) {
                last[i] = 0;
                break;
            }
            at = (at + 1) & (slots - 1);
        }
        if (last[i]) slot_rec[at] = i;
    }
    /* The last touches, gathered table by table (the tables' orders are their own), refreshed in order. */
    Py_ssize_t L = cfg->leader_len;
    uint32_t *where = PyMem_RawMalloc(sizeof(uint32_t) * (size_t)n);
    int *leaders = PyMem_RawMalloc(sizeof(int) * (size_t)(n * L));
    if (!where || !leaders) {
        PyMem_RawFree(where); PyMem_RawFree(leaders); PyMem_RawFree(rec); PyMem_RawFree(slot_rec); PyMem_RawFree(last);
        PyErr_NoMemory();
        return -1;
    }
    for (int t = 0; t < cfg->ntables; t++) {
        Py_ssize_t m = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int table;
            memcpy(&table, rec[i], sizeof table);
            if (!last[i] || table != t) continue;
            memcpy(&where[m], rec[i] + sizeof(int), sizeof(uint32_t));
            memcpy(&leaders[m * L], rec[i] + 2 * sizeof(int), sizeof(int) * (size_t)L);
            m++;
        }
        if (m) lru_api->touch_many(cfg->tables[t], leaders, where, m);
    }
    PyMem_RawFree(where);
    PyMem_RawFree(leaders);
    PyMem_RawFree(rec);
    PyMem_RawFree(slot_rec);
    PyMem_RawFree(last);
    return 0;
}

/* A new reference to PyLong(v) into list[i] (pre-sized); -1 on error. */
static int set_long(PyObject *list, Py_ssize_t i, long v) {
    PyObject *o = PyLong_FromLong(v);
    if (!o) return -1;
    PyList_SET_ITEM(list, i, o);
    return 0;
}

/* A helper's (or the calling thread's) share of a step's drafting: jobs taken one at a time until none is left. */
static void draft_worker(void *arg, int w) {
    StepCtx *sc = arg;
    quiet = 1;
    while (!__atomic_load_n(&sc->failed, __ATOMIC_RELAXED)) {
        Py_ssize_t i = __atomic_fetch_add(&sc->next, 1, __ATOMIC_RELAXED);
        if (i >= sc->njobs) break;
        Job *j = &sc->jobs[i];
        if (j->state == JOB_DRAFT && job_draft(w, sc, j, 0) < 0)
            __atomic_store_n(&sc->failed, 1, __ATOMIC_RELAXED);
    }
    quiet = 0;
}

/* The DraftSession attributes and methods the batched step reads, writes and calls (DraftSession lists them). */
static PyObject *a_tokens, *a_len, *a_last_packed, *a_last_evidence, *a_ema, *a_policy, *a_adaptive, *a_steps,
    *a_drafted, *a_accepted, *m_reserve, *m_batch_state;

static int intern_session_names(void) {
    struct { PyObject **slot; const char *name; } names[] = {
        {&a_tokens, "_tokens"}, {&a_len, "_len"}, {&a_last_packed, "_last_packed"},
        {&a_last_evidence, "_last_evidence"}, {&a_ema, "_ema_accepted"}, {&a_policy, "policy"},
        {&a_adaptive, "adaptive"}, {&a_steps, "steps"}, {&a_drafted, "drafted"}, {&a_accepted, "accepted"},
        {&m_reserve, "reserve"}, {&m_batch_state, "batch_state"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i].slot = PyUnicode_InternFromString(names[i].name))) return -1;
    return 0;
}

/* An int or float attribute of ``obj``; -1 (with an exception) on error. */
static int long_attr(PyObject *obj, PyObject *name, long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    *out = PyLong_AsLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int double_attr(PyObject *obj, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* Sets a new reference (NULL: an error already raised) as an attribute of ``obj``, consuming it. */
static int set_attr(PyObject *obj, PyObject *name, PyObject *value) {
    if (!value) return -1;
    int rc = PyObject_SetAttr(obj, name, value);
    Py_DECREF(value);
    return rc;
}

/* attribute += by, for an int attribute. */
static int add_attr(PyObject *obj, PyObject *name, long by) {
    long v;
    return long_attr(obj, name, &v) < 0 ? -1 : set_attr(obj, name, PyLong_FromLong(v + by));
}

/* Session s's state into job j for the first pass: its draft to score, its averaged acceptance and its tokens'
 * buffer, grown to take k more (DraftSession.batch_state and reserve). */
static int job_read(Job *j, PyObject *sess, long k, double full_budget_ema) {
    j->sess = sess;
    PyObject *ev = PyObject_GetAttr(sess, a_last_evidence);
    if (!ev) return -1;
    int single = ev != Py_None;  /* a draft of the single path: packed first, to be scored the same way */
    Py_DECREF(ev);
    if (single) {
        PyObject *r = PyObject_CallMethodNoArgs(sess, m_batch_state);
        if (!r) return -1;
        Py_DECREF(r);
    }
    if (long_attr(sess, a_len, &j->n) < 0) return -1;
    if (!(j->last = PyObject_GetAttr(sess, a_last_packed))) return -1;
    PyObject *policy = PyObject_GetAttr(sess, a_policy), *adaptive = policy ? PyObject_GetAttr(policy, a_adaptive) : NULL;
    Py_XDECREF(policy);
    j->adaptive = adaptive ? PyObject_IsTrue(adaptive) : -1;
    Py_XDECREF(adaptive);
    if (j->adaptive < 0) return -1;
    j->ema = full_budget_ema;
    if (j->adaptive && double_attr(sess, a_ema, &j->ema) < 0) return -1;
    PyObject *buf = PyObject_GetAttr(sess, a_tokens);
    if (!buf) return -1;
    if (PyObject_GetBuffer(buf, &j->vb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        j->vb.obj = NULL;
        Py_DECREF(buf);
        return -1;
    }
    Py_DECREF(buf);
    if (j->vb.itemsize == 4 && j->vb.len / 4 >= j->n + k) return 0;
    PyBuffer_Release(&j->vb);  /* too small: DraftSession.reserve grows it */
    PyObject *extra = PyLong_FromLong(k);
    buf = extra ? PyObject_CallMethodOneArg(sess, m_reserve, extra) : NULL;
    Py_XDECREF(extra);
    if (!buf) return -1;
    int rc = PyObject_GetBuffer(buf, &j->vb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
    Py_DECREF(buf);
    if (rc < 0) j->vb.obj = NULL;
    return rc;
}

/* What the step did to session j (DraftSession.stepped): its length, the draft it left to score, its average and
 * its counts. */
static int job_write(const Job *j, PyObject *new_last) {
    PyObject *sess = j->sess;
    if (set_attr(sess, a_len, PyLong_FromLong(j->n)) < 0 || set_attr(sess, a_last_packed, Py_NewRef(new_last)) < 0)
        return -1;
    if (j->adaptive) {
        if (set_attr(sess, a_ema, PyFloat_FromDouble(j->ema)) < 0) return -1;
    } else if (j->scored) {  /* the batch saw FULL_BUDGET_EMA: the session's own average goes on from its own */
        double own;
        if (double_attr(sess, a_ema, &own) < 0 ||
            set_attr(sess, a_ema, PyFloat_FromDouble(own + 0.25 * ((double)j->confirmed - own))) < 0)
            return -1;
    }
    if (j->scored && (add_attr(sess, a_steps, 1) < 0 || add_attr(sess, a_drafted, j->scored) < 0 ||
                      add_attr(sess, a_accepted, j->confirmed) < 0))
        return -1;
    return 0;
}

/* Sessions a thread drafts at least, for a step to be drafted on more than one (waking a helper costs some). */
#define JOBS_PER_THREAD 8

/* steps(sessions, accepted, offsets, limits, report, settings)
 * One engine step of many DraftSessions, read and updated in place, in two passes: every session's last packed draft is scored against its
 * accepted tokens and they are appended (teaching the dynamic table), in order; then each one (unless report-only)
 * is drafted within its budget from its own tokens, the store and the tables, as a single draft call after all
 * those corrections would draft it. The second pass only reads what they share (table queries refresh their
 * leaders afterwards, in the same order), so it runs on up to ``threads`` threads at once, and gives the same
 * trees on any number. See ``batch_steps.draft_steps`` for the arguments. */
static PyObject *steps(PyObject *self, PyObject *args) {
    PyObject *sessions, *accepted_o, *offsets, *limits, *report, *settings;
    if (!PyArg_ParseTuple(args, "O!OO!O!O!O!", &PyList_Type, &sessions, &accepted_o, &PyList_Type, &offsets,
                          &PyList_Type, &limits, &PyList_Type, &report, &PyTuple_Type, &settings))
        return NULL;
    PyObject *session_fn, *store_fn, *store_args, *fallback, *dynamic, *tables_obj, *acc_obj, *trials_obj;
    int use_session, use_store, ctx_len, leader_len, max_match, max_occ, max_depth, branch, adaptive, min_nodes;
    int threads;
    double min_prob, strength, horizon, full_budget_ema;
    if (!PyArg_ParseTuple(settings, "iOiOOOOOiiOOddiiidiiiid", &use_session, &session_fn, &use_store, &store_fn,
                          &store_args, &fallback, &dynamic, &tables_obj, &ctx_len, &leader_len, &acc_obj, &trials_obj,
                          &strength, &horizon, &max_match, &max_occ, &max_depth, &min_prob, &branch, &adaptive,
                          &min_nodes, &threads, &full_budget_ema))
        return NULL;
    Py_ssize_t nb = PyList_GET_SIZE(sessions);
    if (PyList_GET_SIZE(offsets) != nb + 1 || PyList_GET_SIZE(limits) != nb || PyList_GET_SIZE(report) != nb) {
        PyErr_SetString(PyExc_ValueError, "per-session lists of different lengths");
        return NULL;
    }
    if (leader_len < 1 || leader_len > MAX_LEADER || ctx_len < 1) {
        PyErr_SetString(PyExc_ValueError, "leader_len out of range");
        return NULL;
    }
    if (session_fn == Py_None) session_fn = NULL;
    if (store_fn == Py_None) store_fn = NULL;
    if (dynamic == Py_None) dynamic = NULL;
    if (store_fn && (!PyTuple_Check(store_args) || PyTuple_GET_SIZE(store_args) != 8)) {
        PyErr_SetString(PyExc_TypeError, "store arguments must be (ring, oldest, end, delta, main, candidates, "
                        "examined, tail)");
        return NULL;
    }
    StepCtx sc;
    memset(&sc, 0, sizeof sc);
    Builder cfg;  /* the tables and settings every worker's builder copies */
    builder_init(&cfg);
    Worker own = {0};
    int owns_pool = !pool_busy;
    if (owns_pool) pool_busy = 1;
    sc.workers = owns_pool ? pool : &own;
    Py_buffer vacc = {0}, vtr = {0}, vin = {0};
    PyObject *tables = NULL, *result = NULL;
    PyObject *o_off = NULL, *o_conf = NULL;
    Buf n_tok = BUF(int), n_par = BUF(int), n_prob = BUF(double), n_kind = BUF(unsigned char), n_lat = BUF(int64_t);
    long drafted_kinds[4] = {0, 0, 0, 0}, confirmed_kinds[4] = {0, 0, 0, 0};
    int kinds_tmp[1024];
    Job *jobs = PyMem_Calloc(nb ? (size_t)nb : 1, sizeof(Job));
    if (!jobs) { PyErr_NoMemory(); goto done; }
    store_view(&sc.view, session_fn, store_fn, store_args);
    sc.use_session = use_session; sc.use_store = use_store;
    sc.max_match = max_match; sc.max_occ = max_occ; sc.max_depth = max_depth; sc.ctx_len = ctx_len;
    sc.session_fn = session_fn; sc.store_fn = store_fn; sc.store_args = store_args; sc.fallback = fallback;
    sc.jobs = jobs; sc.njobs = nb;
    if (PyObject_GetBuffer(accepted_o, &vin, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
    if (vin.itemsize != 4 || (vin.format && strcmp(vin.format, "i") != 0 && strcmp(vin.format, "<i") != 0 &&
                              strcmp(vin.format, "=i") != 0)) {
        PyErr_SetString(PyExc_TypeError, "accepted must be a C-contiguous int32 array");
        goto done;
    }
    if (get_model(acc_obj, trials_obj, &vacc, &vtr, 1) < 0) goto done;
    cfg.acc = (const double *)vacc.buf;
    cfg.trials = (const double *)vtr.buf;
    tables = PySequence_Fast(tables_obj, "tables must be a sequence of (kind, table, branch)");
    if (!tables || parse_tables(&cfg, tables) < 0) goto done;
    cfg.leader_len = leader_len; cfg.max_depth = max_depth; cfg.min_prob = min_prob; cfg.branch = branch;
    sc.m_o = PyLong_FromLong(max_match); sc.occ_o = PyLong_FromLong(max_occ); sc.dep_o = PyLong_FromLong(max_depth);
    o_off = PyList_New(nb + 1); o_conf = PyList_New(nb);  /* filled in the last pass */
    if (!sc.m_o || !sc.occ_o || !sc.dep_o || !o_off || !o_conf || set_long(o_off, 0, 0) < 0 ||
        buf_reserve(&n_lat, nb) < 0)
        goto done;
    const int *flat = (const int *)vin.buf;
    Py_ssize_t nflat = vin.len / 4, ndraft = 0;
    double *acc = (double *)vacc.buf, *trials = (double *)vtr.buf;
    /* First pass: every session's draft scored and its tokens appended, in order. */
    for (Py_ssize_t s = 0; s < nb; s++) {
        int64_t t0 = now_ns();
        Job *j = &jobs[s];
        j->kept_by = -1;
        long lo = list_long(offsets, s), hi = list_long(offsets, s + 1);
        long limit = list_long(limits, s);
        int rep = PyObject_IsTrue(PyList_GET_ITEM(report, s));
        if (PyErr_Occurred() || rep < 0) goto done;
        if (lo < 0 || hi < lo || hi > nflat) {
            PyErr_SetString(PyExc_ValueError, "accepted offsets out of range");
            goto done;
        }
        long k = hi - lo;
        if (job_read(j, PyList_GET_ITEM(sessions, s), k, full_budget_ema) < 0) goto done;
        PyObject *last = j->last;
        long n = j->n;
        double ema = j->ema;
        if (j->vb.itemsize != 4 || j->vb.len / 4 < n + k || n < 0) {
            PyErr_SetString(PyExc_ValueError, "a session buffer is not an int32 array with room for its tokens");
            goto done;
        }
        int *tok = (int *)j->vb.buf;
        const int *a = flat + lo;
        if (k > 0) {
            if (last != Py_None) {
                Packed p;
                if (packed_view(last, &p) < 0) goto done;
                int *kinds = k <= 1024 ? kinds_tmp : PyMem_Malloc(sizeof(int) * (size_t)k);
                if (!kinds) { PyErr_NoMemory(); goto done; }
                long confirmed = score_core(&p, a, k, acc, trials, strength, horizon, kinds);
                for (long i = 0; i < confirmed; i++) confirmed_kinds[kinds[i] & 3]++;
                if (kinds != kinds_tmp) PyMem_Free(kinds);
                if (confirmed < 0) goto done;
                j->confirmed = confirmed;
                j->scored = p.n;
                if (p.n) ema += 0.25 * ((double)confirmed - ema);
            }
            j->appended = 1;
            memcpy(tok + n, a, sizeof(int) * (size_t)k);
            long before = n;
            n += k;
            long from = before > 8 ? before - 8 : 0;  /* the new tokens with the 8 before them */
            if (dynamic && lru_api && Py_TYPE(dynamic) == lru_api->type) {
                if (lru_api->update(dynamic, tok + from, n - from, before - from) < 0) goto done;
            } else if (dynamic) {
                PyObject *window = PySequence_GetSlice(j->vb.obj, from, n);
                PyObject *nf = window ? PyLong_FromLong(before < 8 ? before : 8) : NULL;
                PyObject *uargs[3] = {dynamic, window, nf};
                PyObject *r = nf ? PyObject_VectorcallMethod(update_name, uargs, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                                              NULL) : NULL;
                Py_XDECREF(window);
                Py_XDECREF(nf);
                if (!r) goto done;
                Py_DECREF(r);
            }
        }
        long budget = 0;
        if (!rep) {
            budget = limit;
            if (adaptive) {
                long wanted = (long)nearbyint(min_nodes * (1.0 + 2.0 * ema));
                long floor_ = min_nodes < limit ? min_nodes : limit;
                budget = limit < wanted ? limit : wanted;
                if (budget < floor_) budget = floor_;
            }
        }
        j->n = n;
        j->ema = ema;
        j->budget = budget;
        j->state = budget > 0 && n > 0 ? JOB_DRAFT : JOB_IDLE;
        ndraft += j->state == JOB_DRAFT;
        j->ns = now_ns() - t0;
    }
    /* Second pass: the drafts. The tail's lists are brought up to date once for all the store lookups. */
    if (ndraft && use_store && sc.view.store &&
        kernels_api->store_prepare((const int *)sc.view.ring.buf, sc.view.ring.len / 4, sc.view.oldest, sc.view.end,
                                   sc.view.delta, sc.view.main_ix, sc.view.tail, ndraft) < 0)
        goto done;
    int nthreads = threads < WORKERS_MAX ? threads : WORKERS_MAX;
    if (nthreads > ndraft / JOBS_PER_THREAD) nthreads = (int)(ndraft / JOBS_PER_THREAD);
    if (!owns_pool || !kernels_api || (use_session && !sc.view.session) || (use_store && !sc.view.store) ||
        !tables_native(&cfg))
        nthreads = 1;  /* some lookups or queries go through Python: one thread, holding the GIL */
    if (nthreads < 1) nthreads = 1;
    for (int w = 0; w < nthreads; w++) {
        if (worker_ready(&sc.workers[w]) < 0) goto done;
        builder_configure(&sc.workers[w].B, &cfg);
        sc.workers[w].kept.len = 0;
    }
    if (nthreads > 1) {
        workers_run(nthreads, draft_worker, &sc);
        if (sc.failed) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (Py_ssize_t s = 0; s < nb; s++)  /* what the workers left, or every draft on one thread */
        if (jobs[s].state == JOB_PYTHON || jobs[s].state == JOB_DRAFT)
            if (job_draft(0, &sc, &jobs[s], 1) < 0) goto done;
    /* The table refreshes the drafts deferred, then the trees in order. */
    if (apply_touches(&cfg, jobs, nb, sc.workers) < 0) goto done;
    long node_total = 0;
    for (Py_ssize_t s = 0; s < nb; s++) {
        Job *j = &jobs[s];
        PyObject *new_last;
        KeptHead h;
        const char *pk = kept_tree(sc.workers, j, &h);
        if (pk) {
            const char *probs = pk + h.packed;
            Py_ssize_t nn = h.n;
            if (buf_reserve(&n_tok, nn) < 0 || buf_reserve(&n_par, nn) < 0 || buf_reserve(&n_prob, nn) < 0 ||
                buf_reserve(&n_kind, nn) < 0)
                goto done;
            memcpy(&AT(n_tok, int, n_tok.len), pk + 8, sizeof(int) * (size_t)nn);
            memcpy(&AT(n_par, int, n_par.len), pk + 8 + 4 * nn, sizeof(int) * (size_t)nn);
            memcpy(&AT(n_prob, double, n_prob.len), probs, sizeof(double) * (size_t)nn);
            for (Py_ssize_t i = 0; i < nn; i++) {
                int kind = ld_int(pk + 8 + 8 * nn, i);
                drafted_kinds[kind & 3]++;
                AT(n_kind, unsigned char, n_kind.len + i) = (unsigned char)kind;
            }
            n_tok.len += nn; n_par.len += nn; n_prob.len += nn; n_kind.len += nn;
            node_total += (long)nn;
            /* into the session's last one when it is the step's bytearray: no object made and freed a session */
            if (PyByteArray_CheckExact(j->last) && PyByteArray_Resize(j->last, h.packed) == 0) {
                memcpy(PyByteArray_AS_STRING(j->last), pk, (size_t)h.packed);
                new_last = Py_NewRef(j->last);
            } else {
                PyErr_Clear();  /* exported elsewhere (or bytes): a new one */
                if (!(new_last = PyByteArray_FromStringAndSize(pk, h.packed))) goto done;
            }
        } else {  /* drafted nothing, or not drafted: a spent draft is dropped, an unscored one kept */
            new_last = Py_NewRef(j->state == JOB_DONE || j->appended ? Py_None : j->last);
        }
        int err = job_write(j, new_last);
        Py_DECREF(new_last);
        AT(n_lat, int64_t, s) = j->ns;
        if (err < 0 || set_long(o_off, s + 1, node_total) < 0 || set_long(o_conf, s, j->confirmed) < 0) goto done;
    }
    n_lat.len = nb;
#define BYTES_OF(b) ((b).data ? (const char *)(b).data : ""), (b).len * (b).item  /* y# gives None for NULL */
    result = Py_BuildValue("(Oy#y#y#y#Oy#(llll)(llll))", o_off, BYTES_OF(n_tok), BYTES_OF(n_par),
                           BYTES_OF(n_prob), BYTES_OF(n_kind), o_conf, BYTES_OF(n_lat), drafted_kinds[0],
                           drafted_kinds[1], drafted_kinds[2], drafted_kinds[3], confirmed_kinds[0],
                           confirmed_kinds[1], confirmed_kinds[2], confirmed_kinds[3]);
done:
    if (jobs) {
        for (Py_ssize_t s = 0; s < nb; s++) {
            if (jobs[s].vb.obj) PyBuffer_Release(&jobs[s].vb);
            Py_XDECREF(jobs[s].last);
        }
        PyMem_Free(jobs);
    }
    worker_free(&own);
    if (owns_pool) pool_busy = 0;
    builder_free(&cfg);
    store_view_free(&sc.view);
    if (vacc.obj) PyBuffer_Release(&vacc);
    if (vtr.obj) PyBuffer_Release(&vtr);
    if (vin.obj) PyBuffer_Release(&vin);
    Py_XDECREF(tables);
    Py_XDECREF(sc.m_o); Py_XDECREF(sc.occ_o); Py_XDECREF(sc.dep_o);
    buf_free(&n_tok); buf_free(&n_par); buf_free(&n_prob); buf_free(&n_kind); buf_free(&n_lat);
    Py_XDECREF(o_off); Py_XDECREF(o_conf);
    return result;
}

static PyObject *threads(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(il)", workers_started(), workers_shared_runs());
}

static PyMethodDef methods[] = {
    {"build", build, METH_VARARGS, "Best-first draft tree (see tree_builder.build_tree)."},
    {"score", score, METH_VARARGS, "Record a draft's verification outcome (see tree_builder.score_draft)."},
    {"pack", pack, METH_VARARGS, "A packed draft of a tree and its evidence (see tree_builder.pack_draft)."},
    {"score_packed", score_packed, METH_VARARGS, "score() over a packed draft (see tree_builder.score_packed)."},
    {"steps", steps, METH_VARARGS, "One engine step of many sessions (see batch_steps.draft_steps)."},
    {"threads", threads, METH_NOARGS, "(helper threads started, steps drafted on more than one thread) so far."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree", "Native draft tree builder.", -1, methods};

PyMODINIT_FUNC PyInit__tree(void) {
    query_name = PyUnicode_InternFromString("query");
    update_name = PyUnicode_InternFromString("update");
    if (!query_name || !update_name || intern_session_names() < 0) return NULL;
    PyObject *lru = PyImport_ImportModule("store._lru");  /* PyCapsule_Import does not import submodules */
    Py_XDECREF(lru);
    lru_api = lru ? (LRUTableCAPI *)PyCapsule_Import("store._lru._C_API", 0) : NULL;
    if (!lru_api) PyErr_Clear();  /* not built: tables are queried through Python */
    PyObject *kern = PyImport_ImportModule("store._kernels");
    Py_XDECREF(kern);
    kernels_api = kern ? (KernelsCAPI *)PyCapsule_Import("store._kernels._C_API", 0) : NULL;
    if (!kernels_api || kernels_api->size != sizeof(KernelsCAPI)) {  /* not built, or another layout */
        PyErr_Clear();
        kernels_api = NULL;  /* lookups go through the Python functions the caller passes */
    }
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "NATIVE_TABLES", lru_api != NULL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
