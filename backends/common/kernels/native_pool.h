/* The native kernels' thread pool (native_pool.c): one call's rows split across persistent threads. */
#ifndef QIR_NATIVE_POOL_H
#define QIR_NATIVE_POOL_H
#include <stddef.h>
#include <stdint.h>

/* A kernel over rows [r0, r1) whose arguments are packed in argv (pointers as integers); returns 0,
 * or a count / failure flag the caller sums over the parts. */
typedef int64_t (*qir_rows_fn)(const int64_t *argv, int64_t r0, int64_t r1);

/* fn over [0, rows) on the calling thread and up to nt - 1 pool threads, in about per parts per
 * thread (cut at multiples of grain rows) that the threads claim one at a time; returns the sum of
 * the parts' results. Runs everything on the calling thread when nt <= 1, when another thread is
 * using the pool, or when no thread can be started. */
int64_t qir_pool_run(qir_rows_fn fn, const int64_t *argv, int64_t rows, int64_t nt, int64_t grain, int64_t per);

/* Threads the pool has started (they persist: parked on a condition variable when idle). */
int64_t qir_pool_threads(void);

/* How long an idle pool thread (and the caller waiting for the others) spins before sleeping, in
 * microseconds, outside a hold (qir_pool_hold): a short gap between two calls then costs no
 * wake-up. 0: sleep at once. Returns the previous value. */
int64_t qir_pool_spin_us(int64_t us);

/* delta > 0: hold the pool awake (idle threads spin, yielding their core now and then, until the
 * last hold is released, instead of sleeping after spin_us): a compiled model holds it for a whole
 * call, so no kernel of the call pays a wake-up. delta < 0: release one hold (the threads sleep
 * at their next check once none is left). 0: query. Returns the holds then in place. */
int64_t qir_pool_hold(int64_t delta);

/* How many times a pool thread has gone to sleep since the process started (each costs the next
 * task a wake-up). */
int64_t qir_pool_parked(void);

/* How many times a pool thread, finding itself on the caller's core when a task came, has moved
 * itself to another core of its affinity mask since the process started. */
int64_t qir_pool_moved(void);

/* Work buffers of the calling thread: slot (0 .. QIR_SCRATCH_SLOTS - 1) holds at least bytes,
 * 64-byte aligned, uninitialised, reused by the thread's later calls (the previous contents of the
 * slot are lost when it grows); NULL when out of memory. Freed when the thread exits. */
#define QIR_SCRATCH_SLOTS 2
void *qir_scratch(int slot, size_t bytes);

#endif
