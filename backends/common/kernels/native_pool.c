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
 * waiting a time slice for a late helper. Parts are disjoint row ranges, and every kernel here
 * writes only its own rows: the results do not depend on the split (integer sums, no shared
 * accumulator).
 *
 * Idle threads spin, then sleep on a condition variable. Waking a sleeping thread costs about
 * 12 us on the 2-vCPU machine this was tuned on (the futex wake and the idle vCPU's wake-up), and
 * a batch-1 layer's share is 100-300 us, so between two kernels of one model call the threads
 * must not sleep: while a caller holds the pool (qir_pool_hold, for the whole compiled-model call)
 * idle threads spin however long the gap; otherwise they spin for spin_us after their last part,
 * and once the hold is released they sleep at once instead of spinning into whatever the process
 * runs next. Every spin loop (the pool threads' and the caller's wait for the last parts) gives its
 * core away (sched_yield) every QIR_YIELD_NS: when the machine runs more threads than it has cores,
 * a spinning thread may share a core with the very thread it waits for (the caller, or a helper
 * finishing a part), which would otherwise stall for the spinner's whole time slice.
 *
 * A pool thread that finds itself on the caller's core when a task comes moves to another core of
 * its affinity mask (move_off) rather than only yielding: left there, it stayed there call after call.
 */
#define _GNU_SOURCE /* sched_getcpu */
#include "native_pool.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QIR_RELAX() _mm_pause()
#else
#define QIR_RELAX() ((void)0)
#endif

#define QIR_POOL_MAX 64
/* how long a spin loop runs between two sched_yield calls */
#define QIR_YIELD_NS 20000

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
    int caller_cpu;             /* the core the caller published the task from (-1: unknown) */
    _Atomic int64_t done;       /* parts finished */
    _Atomic int64_t total;      /* the parts' results */
    atomic_int sleepers;        /* pool threads parked on work_cv */
    atomic_int caller_sleeping; /* the caller parked on done_cv */
    atomic_int hold;            /* callers holding the pool awake (qir_pool_hold) */
    _Atomic int64_t parked;     /* times a pool thread went to sleep (qir_pool_parked) */
    _Atomic int64_t wakes;      /* holds that woke the sleeping threads */
    _Atomic int64_t moves;      /* times a pool thread moved itself off the caller's core (qir_pool_moved) */
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

/* Wait until the task generation differs from seen: spin (for spin_ns, or as long as a caller
 * holds the pool), then sleep until a task or a new hold; returns the task word. */
static uint64_t wait_task(uint32_t seen) {
    for (;;) {
        const int64_t start = now_ns(), deadline = start + atomic_load_explicit(&pool.spin_ns, memory_order_relaxed);
        int64_t next_yield = start + QIR_YIELD_NS;
        uint64_t w;
        for (unsigned k = 1;; ++k) {
            w = atomic_load_explicit(&pool.word, memory_order_acquire);
            if ((uint32_t)(w >> 32) != seen) return w;
            QIR_RELAX();
            if ((k & 63) != 0) continue;
            const int64_t t = now_ns();
            if (t >= deadline && atomic_load_explicit(&pool.hold, memory_order_relaxed) == 0) break;
            if (t >= next_yield) {
                sched_yield();
                next_yield = t + QIR_YIELD_NS;
            }
        }
        pthread_mutex_lock(&pool.mu);
        atomic_fetch_add(&pool.sleepers, 1);
        /* seq_cst: the caller publishes the task (or takes a hold), then reads sleepers; either it sees
         * this thread counted (and broadcasts under the mutex) or these loads see the task or the hold */
        const int64_t wakes = atomic_load(&pool.wakes);
        int slept = 0; /* counted once, and only when it waits: a hold taken since the spin ended is no park */
        while ((uint32_t)((w = atomic_load(&pool.word)) >> 32) == seen && atomic_load(&pool.wakes) == wakes &&
               atomic_load(&pool.hold) == 0) {
            if (!slept) atomic_fetch_add_explicit(&pool.parked, 1, memory_order_relaxed);
            slept = 1;
            pthread_cond_wait(&pool.work_cv, &pool.mu);
        }
        atomic_fetch_sub(&pool.sleepers, 1);
        pthread_mutex_unlock(&pool.mu);
        if ((uint32_t)(w >> 32) != seen) return w;
        /* woken by a new hold: spin again */
    }
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

/* Move the calling pool thread (number id) off core cpu (the caller's) onto another core of its
 * affinity mask, then give it its whole mask back; returns whether it now runs elsewhere.
 *
 * Why: the scheduler wakes a thread on or near the core of the thread that woke it, and a pool
 * thread woken by the caller (each call's hold) can land on the caller's core and stay there call
 * after call: the helper only ever sits its tasks out (or takes turns with the caller), the other
 * core idles, and a 2-thread call runs at the 1-thread speed for the life of the process (resnet18
 * batch 1: 11.6 ms instead of 7-8 ms in five processes of six, depending on where the first
 * wake-ups happened to land). Nothing pulls it back: it sleeps or yields most of the time, so the
 * load balancer sees no load to move. Pinning it to the one core for a moment makes the kernel
 * migrate it at once; with its mask restored it stays there (a running thread is not moved while its
 * core is in its mask) until a later wake-up places it otherwise. Helper number id goes to the
 * id-th allowed core after the caller's, so several helpers spread out. */
static int move_off(int cpu, int64_t id) {
    cpu_set_t mask, one;
    if (sched_getaffinity(0, sizeof mask, &mask) != 0 || CPU_COUNT(&mask) < 2) return 0;
    const int others = CPU_COUNT(&mask) - (CPU_ISSET(cpu, &mask) ? 1 : 0);
    int k = (int)((id - 1) % others), target = -1;
    for (int step = 1; step < CPU_SETSIZE && target < 0; ++step) {
        const int c = (cpu + step) % CPU_SETSIZE;
        if (CPU_ISSET(c, &mask) && k-- == 0) target = c;
    }
    if (target < 0) return 0;
    CPU_ZERO(&one);
    CPU_SET(target, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) return 0;
    const int moved = sched_getcpu() != cpu;
    sched_setaffinity(0, sizeof mask, &mask);
    if (moved) atomic_fetch_add_explicit(&pool.moves, 1, memory_order_relaxed);
    return moved;
}

static void *worker(void *arg) {
    const int64_t id = (int64_t)(intptr_t)arg; /* 1 .. started: the caller is 0 */
    uint32_t seen = (uint32_t)(atomic_load(&pool.word) >> 32);
    for (;;) {
        const uint64_t w = wait_task(seen);
        seen = (uint32_t)(w >> 32);
        /* a thread past the task's count sits it out (a stale count only costs a missed part); one the
         * scheduler has put on the caller's core, where it could only run the parts by taking turns with
         * the caller, moves to another core (move_off), or where it cannot, gives the core back at once
         * and the caller runs them all */
        if (id >= pool.nt) continue;
        if (pool.caller_cpu >= 0 && sched_getcpu() == pool.caller_cpu && !move_off(pool.caller_cpu, id)) {
            sched_yield();
            continue;
        }
        run_parts(seen, w);
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
    atomic_store(&pool.hold, 0); /* the holding call was the parent's */
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
        char name[16]; /* what top -H and /proc/<pid>/task/<tid>/comm show */
        snprintf(name, sizeof name, "qir-pool-%d", pool.started);
        pthread_setname_np(t, name);
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
    pool.caller_cpu = sched_getcpu();
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
    const int64_t start = now_ns(), deadline = start + atomic_load_explicit(&pool.spin_ns, memory_order_relaxed);
    int64_t next_yield = start + QIR_YIELD_NS;
    for (unsigned k = 1; atomic_load_explicit(&pool.done, memory_order_acquire) < parts; ++k) {
        QIR_RELAX();
        if ((k & 63) != 0) continue;
        const int64_t t = now_ns();
        if (t >= deadline) {
            pthread_mutex_lock(&pool.mu);
            atomic_store(&pool.caller_sleeping, 1);
            while (atomic_load(&pool.done) < parts) pthread_cond_wait(&pool.done_cv, &pool.mu);
            atomic_store(&pool.caller_sleeping, 0);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
        if (t >= next_yield) {
            sched_yield(); /* the helper finishing the last part may be waiting for this core */
            next_yield = t + QIR_YIELD_NS;
        }
    }
    const int64_t total = atomic_load(&pool.total);
    atomic_flag_clear(&pool.busy);
    return total;
}

int64_t qir_pool_threads(void) { return pool.started; }

int64_t qir_pool_hold(int64_t delta) {
    if (delta > 0) {
        const int h = atomic_fetch_add(&pool.hold, 1) + 1;
        /* wake the sleeping threads now: by the call's first split kernel they spin */
        if (atomic_load(&pool.sleepers) > 0) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.wakes, 1);
            pthread_cond_broadcast(&pool.work_cv);
            pthread_mutex_unlock(&pool.mu);
        }
        return h;
    }
    if (delta < 0) {
        int h = atomic_load(&pool.hold);
        while (h > 0 && !atomic_compare_exchange_weak(&pool.hold, &h, h - 1)) {
        }
        return h > 0 ? h - 1 : 0;
    }
    return atomic_load(&pool.hold);
}

int64_t qir_pool_parked(void) { return atomic_load(&pool.parked); }

int64_t qir_pool_moved(void) { return atomic_load(&pool.moves); }

int64_t qir_pool_spin_us(int64_t us) {
    const int64_t prev = atomic_load(&pool.spin_ns) / 1000;
    if (us >= 0) atomic_store(&pool.spin_ns, (us < 1000000 ? us : 1000000) * 1000);
    return prev;
}

/* Per-thread work buffers: a kernel's chunk buffers (a few hundred KiB) are taken once per thread and
 * reused by every later call, instead of a malloc (and a calloc's zeroing) per call and per part;
 * reused, they also stay in that core's cache. Freed when the thread exits. */
typedef struct {
    void *p[QIR_SCRATCH_SLOTS];
    size_t n[QIR_SCRATCH_SLOTS];
} scratch_set;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ok;

static void scratch_free(void *v) {
    scratch_set *s = (scratch_set *)v;
    for (int i = 0; i < QIR_SCRATCH_SLOTS; ++i) free(s->p[i]);
    free(s);
}

static void scratch_init(void) { scratch_ok = pthread_key_create(&scratch_key, scratch_free) == 0; }

void *qir_scratch(int slot, size_t bytes) {
    if (slot < 0 || slot >= QIR_SCRATCH_SLOTS) return NULL;
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_ok) return NULL;
    scratch_set *s = (scratch_set *)pthread_getspecific(scratch_key);
    if (!s) {
        s = (scratch_set *)calloc(1, sizeof *s);
        if (!s) return NULL;
        if (pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->n[slot] < bytes) {
        free(s->p[slot]);
        const size_t size = (bytes + 63) / 64 * 64; /* aligned_alloc takes a multiple of the alignment */
        s->p[slot] = aligned_alloc(64, size);
        s->n[slot] = s->p[slot] ? size : 0;
    }
    return s->p[slot];
}
