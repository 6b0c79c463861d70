/* A small thread team for the C kernels: run one job on `nt` threads (the caller is thread 0), with a
 * spinning barrier between a job's phases. decode_step.c runs the whole decode step as one job.
 *
 * Why not OpenMP: libgomp shortens its waits to ~100 spins as soon as it manages more threads than CPUs,
 * and it keeps one pool per calling thread, so a process that ran torch ops on two threads (each with
 * its pool) already counts as oversubscribed on a 2-core machine. Each of the step's ~60 barriers then
 * became a futex sleep and wake: the batch-1 step took 3.9 ms instead of 0.7 in a worker thread (the
 * engine steps in one under AsyncLLMEngine and bench/throughput.py). This team's barrier spins (with
 * `pause`, then sched_yield, so an oversubscribed host still makes progress); idle workers spin ~100 us
 * after a job, then sleep on a condition variable until the next.
 *
 *   team_run(job, arg, nt):   caller ──job(arg, 0, nt)──┐
 *                             worker 1 ─job(arg, 1, nt)──┼── all returned: team_run returns
 *                             worker 2 ─job(arg, 2, nt)──┘
 *
 * One job at a time: a second caller that finds the team busy (another engine in the process, another
 * thread) runs its job alone, on its own thread (nt = 1). A forked child starts with no workers. The team
 * never outnumbers the CPUs the process may run on: a barrier waits for its slowest thread, and with more
 * threads than CPUs some thread is always descheduled (a c=32 step on 2 cores: 3.9 ms on 1 thread, 48 ms
 * on 4). */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "team.h"

#define MAX_WORKERS 63
#define IDLE_SPIN_NS 100000 /* a worker spins this long after a job before it sleeps */

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int workers;             /* started (guarded by run_lock) */
static unsigned start_gen[MAX_WORKERS + 1]; /* the job generation when worker i was started */
static int forked_handler;      /* pthread_atfork registered */
static atomic_uint job_gen;     /* bumped per job: workers wait for a change */
static atomic_int job_done;     /* workers finished with the current job */
static team_job job_fn;
static void *job_arg;
static int job_nt;
static atomic_int bar_count;
static atomic_uint bar_gen;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Spin until *v != seen; after `yield_after` spins, yield the CPU between checks. */
static void wait_change(atomic_uint *v, unsigned seen, int yield_after) {
    for (int i = 0; atomic_load_explicit(v, memory_order_acquire) == seen; i++) {
        if (i < yield_after) cpu_relax();
        else sched_yield();
    }
}

void team_barrier(int nt) {
    if (nt <= 1) return;
    const unsigned g = atomic_load_explicit(&bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&bar_count, 1, memory_order_acq_rel) == nt - 1) {
        atomic_store_explicit(&bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&bar_gen, 1, memory_order_release);
    } else {
        wait_change(&bar_gen, g, 2000);
    }
}

static void *worker_main(void *p) {
    const int tid = (int)(intptr_t)p;
    unsigned seen = start_gen[tid]; /* not job_gen now: the job it was started for may have begun */
    for (;;) {
        const int64_t spin_until = now_ns() + IDLE_SPIN_NS;
        for (int i = 0; atomic_load_explicit(&job_gen, memory_order_acquire) == seen; i++) {
            cpu_relax();
            if ((i & 255) == 255 && now_ns() > spin_until) { /* idle: sleep until the next job */
                pthread_mutex_lock(&wake_lock);
                while (atomic_load_explicit(&job_gen, memory_order_acquire) == seen)
                    pthread_cond_wait(&wake, &wake_lock);
                pthread_mutex_unlock(&wake_lock);
            }
        }
        seen = atomic_load_explicit(&job_gen, memory_order_acquire);
        if (tid < job_nt) job_fn(job_arg, tid, job_nt);
        atomic_fetch_add_explicit(&job_done, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* The parent's workers do not exist here; the locks may have been held by one of them. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;
    run_lock = fresh;
    wake_lock = fresh;
    wake = fresh_cv;
    workers = 0;
    atomic_store(&bar_count, 0);
}

/* The CPUs this process may run on (its affinity mask), read once. */
static int usable_cpus(void) {
    static int n;
    if (n == 0) {
        cpu_set_t set;
        n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
        if (n < 1) n = 1;
    }
    return n;
}

int team_run(team_job job, void *arg, int nt) {
    if (nt > usable_cpus()) nt = usable_cpus();
    if (nt > MAX_WORKERS + 1) nt = MAX_WORKERS + 1;
    if (nt <= 1 || pthread_mutex_trylock(&run_lock) != 0) {
        job(arg, 0, 1);
        return 1;
    }
    if (!forked_handler) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        forked_handler = 1;
    }
    while (workers < nt - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_gen[workers + 1] = atomic_load_explicit(&job_gen, memory_order_relaxed);
        const int ok = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(workers + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        workers++;
    }
    if (nt > workers + 1) nt = workers + 1;
    job_fn = job, job_arg = arg, job_nt = nt;
    atomic_store_explicit(&job_done, 0, memory_order_relaxed);
    pthread_mutex_lock(&wake_lock); /* a worker between its last check and its wait sees the new generation */
    atomic_fetch_add_explicit(&job_gen, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&wake_lock);
    job(arg, 0, nt);
    for (int i = 0; atomic_load_explicit(&job_done, memory_order_acquire) < workers; i++) {
        if (i < 2000) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&run_lock);
    return nt;
}
