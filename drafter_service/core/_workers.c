/* A small pool of helper threads for the batched step (see _workers.h). */

#include <pthread.h>
#include <signal.h>
#include <stdint.h>

#include "_workers.h"

static struct {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    int started;                  /* helpers running: ids 1 .. started */
    unsigned long gen;            /* bumped for every job */
    unsigned long born[WORKERS_MAX];  /* the generation each helper was started in (it waits for the next) */
    int want;                     /* helpers taking part in the current job: ids 1 .. want */
    int active;                   /* of those, still running it */
    void (*fn)(void *, int);
    void *ctx;
    int atfork;                   /* the fork handler is registered */
    long shared_runs;             /* jobs run on more than one thread */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void *helper(void *arg) {
    int id = (int)(intptr_t)arg;
    pthread_mutex_lock(&P.mu);
    unsigned long seen = P.born[id];
    for (;;) {
        while (P.gen == seen) pthread_cond_wait(&P.go, &P.mu);
        seen = P.gen;
        if (id > P.want) continue;
        void (*fn)(void *, int) = P.fn;
        void *ctx = P.ctx;
        pthread_mutex_unlock(&P.mu);
        fn(ctx, id);
        pthread_mutex_lock(&P.mu);
        if (--P.active == 0) pthread_cond_signal(&P.done);
    }
    return NULL;
}

/* A forked child has none of the helpers: it starts its own when it needs them. */
static void after_fork_in_child(void) {
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.go, NULL);
    pthread_cond_init(&P.done, NULL);
    P.started = P.want = P.active = 0;
}

/* Starts helpers until ``n`` run (P.mu held); stops at the first that cannot be started. */
static void start_helpers(int n) {
    if (!P.atfork && pthread_atfork(NULL, NULL, after_fork_in_child) == 0) P.atfork = 1;
    if (!P.atfork) return;  /* without the handler a forked child would wait for helpers it does not have */
    while (P.started < n) {
        int id = P.started + 1;
        P.born[id] = P.gen;
        sigset_t all, old;  /* signals stay with the Python threads: helpers start with all of them blocked */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t th;
        int rc = pthread_create(&th, &attr, helper, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc != 0) return;
        P.started = id;
    }
}

int workers_run(int n, void (*fn)(void *ctx, int w), void *ctx) {
    if (n > WORKERS_MAX) n = WORKERS_MAX;
    if (n <= 1) {
        fn(ctx, 0);
        return 1;
    }
    pthread_mutex_lock(&P.mu);
    if (P.started < n - 1) start_helpers(n - 1);
    int helpers = P.started < n - 1 ? P.started : n - 1;
    P.fn = fn;
    P.ctx = ctx;
    P.want = helpers;
    P.active = helpers;
    P.gen++;
    if (helpers) {
        P.shared_runs++;
        pthread_cond_broadcast(&P.go);
    }
    pthread_mutex_unlock(&P.mu);
    fn(ctx, 0);
    pthread_mutex_lock(&P.mu);
    while (P.active > 0) pthread_cond_wait(&P.done, &P.mu);
    pthread_mutex_unlock(&P.mu);
    return helpers + 1;
}

int workers_started(void) {
    pthread_mutex_lock(&P.mu);
    int n = P.started;
    pthread_mutex_unlock(&P.mu);
    return n;
}

long workers_shared_runs(void) {
    pthread_mutex_lock(&P.mu);
    long n = P.shared_runs;
    pthread_mutex_unlock(&P.mu);
    return n;
}
