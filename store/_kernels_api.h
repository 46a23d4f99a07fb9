/* The store kernels' C API (store._kernels, capsule ``_C_API``), for other extensions: the one declaration that
 * store/_kernels.c fills and drafter_service/core/_tree.c calls. */
#ifndef DRAFTER_STORE_KERNELS_API_H
#define DRAFTER_STORE_KERNELS_API_H

#include <Python.h>
#include <stdint.h>

typedef struct Lookup Lookup;  /* a lookup's working memory (defined in _kernels.c) */

/* A lookup's answer: what followed the longest match (see TokenStore.lookup). Its arrays live in the
 * Lookup that produced it, until that Lookup's next call. */
typedef struct {
    int64_t m;              /* tokens matched (0: nothing found; nothing else is set then) */
    const int64_t *counts;  /* (m,) occurrences of the last 1, 2, ..., m context tokens */
    Py_ssize_t k, depth;    /* rows: (k, depth) */
    const int32_t *rows;    /* the tokens after each chosen occurrence, most recent first, -1 padded */
} LookupResult;

/* C API for other extensions (the native batched step of drafter_service.core._tree): the store and session
 * lookups over raw int32 arrays, answered into a Lookup's memory instead of new numpy arrays. Each returns 0
 * (out->m == 0: nothing matched), 1 for arguments it does not handle (the caller then runs the Python
 * lookup, as for NotImplemented) or -1 with an exception set. */
/* TokenStore.lookup of context[:n] over ring[0, cap) (slots of absolute positions [oldest, stop)), the delta and
 * main Index handles and the Tail (each may be None). */
typedef int StoreLookupFn(Lookup *L, const int32_t *context, Py_ssize_t n, const int32_t *ring, Py_ssize_t cap,
                          int64_t oldest, int64_t stop, PyObject *delta, PyObject *main_ix, PyObject *tail,
                          int64_t max_match, int64_t max_occ, int64_t depth, int64_t max_cand, int64_t max_exam,
                          LookupResult *out);
/* DraftSession.lookup over tokens[:n] (the session's buffer holds cap >= n tokens). */
typedef int SessionLookupFn(Lookup *L, const int32_t *tokens, Py_ssize_t cap, int64_t n, int64_t max_match,
                            int64_t max_occ, int64_t depth, LookupResult *out);

typedef struct {
    size_t size;  /* sizeof(KernelsCAPI): a caller built against another layout must not use it */
    Lookup *(*lookup_new)(void);
    void (*lookup_free)(Lookup *L);
    StoreLookupFn *store_lookup;
    SessionLookupFn *session_lookup;
    /* Lookups that may run on several threads at once, on threads without a Python thread state too (each with
     * its own Lookup): store_lookup that only reads the Tail, after store_prepare (GIL held) brought its lists up to
     * date when that costs less than ``lookups`` scans (however far behind they are), and session_lookup. They raise
     * nothing: -1 means out of memory. store_prepare returns 0, or -1 with an exception set. */
    StoreLookupFn *store_lookup_shared;
    SessionLookupFn *session_lookup_shared;
    int (*store_prepare)(const int32_t *ring, Py_ssize_t cap, int64_t oldest, int64_t stop, PyObject *delta,
                         PyObject *main_ix, PyObject *tail, Py_ssize_t lookups);
} KernelsCAPI;

#endif
