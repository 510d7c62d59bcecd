/* The native kernels' thread pool: one kernel call's rows split across persistent pthreads.
 *
 * Why not Python threads: a hand-off through a Python thread pool (a future, a queue, the GIL
 * passed back and forth) costs tens of microseconds, several times a batch-1 layer's share of
 * the work. Why not OpenMP: torch carries its own OpenMP runtime, and a second one in this
 * library would keep a second set of threads spinning against it for the same two cores.
 *
 * A call's rows are cut into a few parts per thread; the caller publishes the task, and it and
 * the pool's threads claim parts until none is left, so a thread the machine does not schedule
 * in time costs a part, not the call: on a shared machine the caller finishes alone rather than
 * waiting a time slice for a late helper. Idle threads spin for spin_us (the gap between two
 * kernels of one model call is shorter, so the next hand-off costs no wake-up), then sleep on a
 * condition variable. Parts are disjoint row ranges, and every kernel here writes only its own
 * rows: the results do not depend on the split (integer sums, no shared accumulator).
 */
#define _POSIX_C_SOURCE 200809L
#include "native_pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QIR_RELAX() _mm_pause()
#else
#define QIR_RELAX() ((void)0)
#endif

#define QIR_POOL_MAX 64

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    /* the current task's generation (high 32 bits) and its next unclaimed part (low 32 bits): a
     * thread claims a part with a compare-and-swap that fails once the task has changed, so a
     * thread that wakes late never runs a part of a task it did not read */
    _Atomic uint64_t word;
    qir_rows_fn fn;
    const int64_t *argv;
    int64_t rows, units, grain, parts, nt;
    _Atomic int64_t done;       /* parts finished */
    _Atomic int64_t total;      /* the parts' results */
    atomic_int sleepers;        /* pool threads parked on work_cv */
    atomic_int caller_sleeping; /* the caller parked on done_cv */
    atomic_flag busy;           /* one caller at a time; others run their call alone */
    int started;                /* pool threads running (numbered 1 .. started) */
    int atfork;                 /* the fork handler is registered */
    _Atomic int64_t spin_ns;
} pool = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .work_cv = PTHREAD_COND_INITIALIZER,
    .done_cv = PTHREAD_COND_INITIALIZER,
    .busy = ATOMIC_FLAG_INIT,
    .spin_ns = 100000,
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Wait until the task generation differs from seen: spin, then sleep; returns the task word. */
static uint64_t wait_task(uint32_t seen) {
    const int64_t deadline = now_ns() + atomic_load_explicit(&pool.spin_ns, memory_order_relaxed);
    uint64_t w;
    for (unsigned k = 1; (uint32_t)((w = atomic_load_explicit(&pool.word, memory_order_acquire)) >> 32) == seen;
         ++k) {
        QIR_RELAX();
        if ((k & 63) == 0 && now_ns() >= deadline) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            /* seq_cst: the caller publishes the task, then reads sleepers; either it sees this
             * thread counted (and broadcasts under the mutex) or this load sees the task */
            while ((uint32_t)((w = atomic_load(&pool.word)) >> 32) == seen)
                pthread_cond_wait(&pool.work_cv, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
    }
    return w;
}

static int64_t bound(int64_t i) {
    const int64_t r = pool.units * i / pool.parts * pool.grain;
    return r < pool.rows ? r : pool.rows;
}

/* Claim and run parts of task gen until none is left (or the task is no longer gen). */
static void run_parts(uint32_t gen, uint64_t w) {
    const qir_rows_fn fn = pool.fn;
    const int64_t *argv = pool.argv;
    const int64_t parts = pool.parts;
    for (;;) {
        if ((uint32_t)(w >> 32) != gen || (int64_t)(uint32_t)w >= parts) return;
        if (!atomic_compare_exchange_weak(&pool.word, &w, w + 1)) continue; /* w reloaded */
        const int64_t i = (int64_t)(uint32_t)w;
        atomic_fetch_add(&pool.total, fn(argv, bound(i), bound(i + 1)));
        if (atomic_fetch_add(&pool.done, 1) == parts - 1 && atomic_load(&pool.caller_sleeping)) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done_cv);
            pthread_mutex_unlock(&pool.mu);
        }
        w = atomic_load(&pool.word);
    }
}

static void *worker(void *arg) {
    const int64_t id = (int64_t)(intptr_t)arg; /* 1 .. started: the caller is 0 */
    uint32_t seen = (uint32_t)(atomic_load(&pool.word) >> 32);
    for (;;) {
        const uint64_t w = wait_task(seen);
        seen = (uint32_t)(w >> 32);
        /* a thread past the task's count sits it out (a stale count only costs a missed part) */
        if (id < pool.nt) run_parts(seen, w);
    }
    return NULL;
}

/* In a forked child only the forking thread exists: forget the pool's threads (they restart on demand). */
static void after_fork_child(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work_cv, NULL);
    pthread_cond_init(&pool.done_cv, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.caller_sleeping, 0);
    atomic_flag_clear(&pool.busy);
    pool.started = 0;
}

/* Start threads until want run (called holding busy); returns how many run. */
static int start_threads(int want) {
    if (!pool.atfork) pool.atfork = pthread_atfork(NULL, NULL, after_fork_child) == 0;
    sigset_t all, old;
    sigfillset(&all);
    /* pool threads inherit a mask blocking every signal: signals stay with the interpreter's threads */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (pool.started < want) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &at, worker, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        ++pool.started;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.started;
}

int64_t qir_pool_run(qir_rows_fn fn, const int64_t *argv, int64_t rows, int64_t nt, int64_t grain, int64_t per) {
    if (rows <= 0) return 0;
    if (grain < 1) grain = 1;
    if (per < 1) per = 1;
    const int64_t units = (rows + grain - 1) / grain;
    if (nt > units) nt = units;
    if (nt > QIR_POOL_MAX) nt = QIR_POOL_MAX;
    if (nt <= 1 || atomic_flag_test_and_set(&pool.busy)) return fn(argv, 0, rows);
    if (pool.started < nt - 1 && start_threads((int)nt - 1) < nt - 1) nt = pool.started + 1;
    if (nt <= 1) {
        atomic_flag_clear(&pool.busy);
        return fn(argv, 0, rows);
    }
    int64_t parts = nt * per;
    if (parts > units) parts = units;
    if (parts > 0x7fffffff) parts = 0x7fffffff;
    pool.fn = fn, pool.argv = argv, pool.rows = rows, pool.units = units, pool.grain = grain;
    pool.parts = parts, pool.nt = nt;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.total, 0);
    const uint32_t gen = (uint32_t)(atomic_load(&pool.word) >> 32) + 1;
    atomic_store(&pool.word, (uint64_t)gen << 32); /* seq_cst: publishes the task, ordered before the read of sleepers */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.work_cv);
        pthread_mutex_unlock(&pool.mu);
    }
    run_parts(gen, atomic_load(&pool.word));
    const int64_t deadline = now_ns() + atomic_load_explicit(&pool.spin_ns, memory_order_relaxed);
    for (unsigned k = 1; atomic_load_explicit(&pool.done, memory_order_acquire) < parts; ++k) {
        QIR_RELAX();
        if ((k & 63) == 0 && now_ns() >= deadline) {
            pthread_mutex_lock(&pool.mu);
            atomic_store(&pool.caller_sleeping, 1);
            while (atomic_load(&pool.done) < parts) pthread_cond_wait(&pool.done_cv, &pool.mu);
            atomic_store(&pool.caller_sleeping, 0);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
    }
    const int64_t total = atomic_load(&pool.total);
    atomic_flag_clear(&pool.busy);
    return total;
}

int64_t qir_pool_threads(void) { return pool.started; }

int64_t qir_pool_spin_us(int64_t us) {
    const int64_t prev = atomic_load(&pool.spin_ns) / 1000;
    if (us >= 0) atomic_store(&pool.spin_ns, (us < 1000000 ? us : 1000000) * 1000);
    return prev;
}
