/* The native LRU table's C API (store._lru, capsule ``_C_API``), for other extensions: the one declaration that
 * store/_lru.c fills and drafter_service/core/_tree.c calls. */
#ifndef DRAFTER_STORE_LRU_API_H
#define DRAFTER_STORE_LRU_API_H

#include <Python.h>
#include <stdint.h>

#define LRU_API_NIL UINT32_MAX  /* a peek's ``where`` for an unknown leader */

/* C API for other extensions (the native tree builder): a query that writes followers into caller
 * buffers instead of building Python objects. Same semantics as LRUTable.query. */
typedef struct {
    PyTypeObject *type;
    /* Followers of ``leader`` (ll tokens), most recent first, at most ``limit``: tokens into out_tokens
     * (limit * fl words), counts into out_counts; the follower length into *fl_out. Returns the number
     * of followers (0 for an unknown leader). Refreshes the leader. */
    int (*query)(PyObject *table, const int32_t *leader, int limit, int32_t *out_tokens, int64_t *out_counts,
                 int *fl_out);
    int (*leader_len)(PyObject *table);
    /* LRUTable.update(tokens[:n], new_from) over raw int32 tokens: the pairs inserted, or -1 with ValueError
     * set for a token id outside [0, 2**31) among those read (nothing is inserted then). */
    Py_ssize_t (*update)(PyObject *table, const int32_t *tokens, Py_ssize_t n, Py_ssize_t new_from);
    /* query that leaves the leader's recency alone: it only reads the table, so several threads may peek at once
     * while nothing changes it. *where: the leader's node for ``touch`` (NIL when unknown). */
    int (*peek)(PyObject *table, const int32_t *leader, int limit, int32_t *out_tokens, int64_t *out_counts,
                int *fl_out, uint32_t *where);
    /* Refreshes ``leader`` (found at node ``where`` by a peek, or looked up again when the table changed since),
     * as the query it stands for would have; nothing for a leader the table no longer holds. */
    void (*touch)(PyObject *table, const int32_t *leader, uint32_t where);
    /* touch for n leaders (leaders: n * LL tokens) one after another, their nodes read ahead. */
    void (*touch_many)(PyObject *table, const int32_t *leaders, const uint32_t *where, Py_ssize_t n);
} LRUTableCAPI;

#endif
