/* A small pool of helper threads for the batched step: one job run on several threads at once. */
#ifndef DRAFTER_WORKERS_H
#define DRAFTER_WORKERS_H

#define WORKERS_MAX 16

/* Runs fn(ctx, w) for w = 0 .. n-1 at once, w = 0 on the calling thread and the others on helper threads (started
 * on first use, kept sleeping between calls), and returns once all have returned. The helpers hold no Python
 * thread state: fn must not touch Python objects or the Python allocator there. n is clamped to [1, WORKERS_MAX];
 * when helpers cannot be started, fewer run (down to the caller alone). Returns how many ran. Not reentrant: the
 * caller serialises calls (the batched step calls it holding the GIL, and nothing it runs releases it). */
int workers_run(int n, void (*fn)(void *ctx, int w), void *ctx);

/* Helper threads started, and jobs run on more than one thread, so far in this process. */
int workers_started(void);
long workers_shared_runs(void);

#endif
