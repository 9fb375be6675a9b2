/* A pool of POSIX threads running positional vector IO (pwritev / preadv) for the NVMe tier.

   Python submits each IO (a run of adjacent slots: one file offset, several buffers) and goes on;
   a pool thread that finishes one IO takes the next queued one at once, without the GIL and
   without waking a Python thread in between. Finished IOs wait in a done list until a reaper
   (one Python thread, blocked in kvs_io_reap without the GIL) collects them with their status.

       submit -> [ queue ] -> pool threads: pwritev / preadv -> [ done ] -> kvs_io_reap

   Closing stops new submissions, lets the queued IOs run, joins the threads; kvs_io_reap then
   hands out what is left and answers -1 once nothing is. The buffers are the caller's until their
   IO is reaped. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 64

typedef struct io_req {
    struct io_req* next;
    int64_t tag;
    int fd;
    int write;
    int64_t offset;
    int niov;
    int err;  // 0, an errno, or EIO for a short transfer
    double start, end;  // when the syscall began and returned, CLOCK_MONOTONIC seconds
    uint32_t* crcs;  // for a read: each buffer's CRC-32 over [crc_offset, crc_offset + crc_len), or NULL
    int64_t crc_offset, crc_len;
    struct iovec iov[];
} io_req;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work;  // a request queued, or closing
    pthread_cond_t done;  // a request done, or the last thread gone
    io_req *queue_head, *queue_tail, *done_head, *done_tail;
    int closing;
    int running;  // threads not yet exited
    int num_threads;
    int64_t slice_us;  // the scheduler slice each thread asks for as it starts; 0: none
    int short_slice;  // threads whose request the kernel took
    int in_syscall[2];  // IOs in their syscall now, by kind (0 read, 1 write)
    double since[2], busy[2];  // when the current busy spell of a kind began; seconds of those before
    pthread_t threads[MAX_THREADS];
} io_pool;

/* sched_setattr's argument (linux/sched/types.h), which glibc does not declare */
typedef struct {
    uint32_t size, policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
} sched_attr_t;

/* Ask for a short scheduler slice for this thread, as tiering/disk_io.py request_short_slice does
   for Python threads (see there why): SCHED_OTHER, its own nice value, runtime = the slice. */
static int request_short_slice(int64_t slice_us) {
#ifdef SYS_sched_setattr
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, 0);  // the calling thread's, on Linux
    if (nice == -1 && errno) return 0;
    sched_attr_t attr = {sizeof(sched_attr_t), 0, 0, nice, 0, (uint64_t)slice_us * 1000, 0, 0};
    return syscall(SYS_sched_setattr, 0, &attr, 0) == 0;
#else
    (void)slice_us;
    return 0;
#endif
}

static void push(io_req** head, io_req** tail, io_req* r) {
    r->next = NULL;
    if (*tail) (*tail)->next = r; else *head = r;
    *tail = r;
}

static io_req* pop(io_req** head, io_req** tail) {
    io_req* r = *head;
    if (r) {
        *head = r->next;
        if (!*head) *tail = NULL;
    }
    return r;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

uint32_t kvs_crc32(uint32_t init, const uint8_t* p, int64_t n);  // crc32.c

/* After a read: each buffer's checksum over its span, on this thread, so that the reaper (one Python
   thread) only compares numbers. A buffer too short for the span keeps the value the caller put
   there. */
static void checksum(io_req* r) {
    for (int i = 0; i < r->niov; i++)
        if (r->crc_offset + r->crc_len <= (int64_t)r->iov[i].iov_len)
            r->crcs[i] = kvs_crc32(0, (const uint8_t*)r->iov[i].iov_base + r->crc_offset, r->crc_len);
}

/* Under the pool's lock: an IO of r's kind enters (+1) or leaves (-1) its syscall at r's stamp, so
   that busy[kind] sums the spells with any such IO in its syscall (the union of their intervals). */
static void in_syscall(io_pool* p, io_req* r, int step) {
    int k = r->write != 0;
    if (step > 0 && p->in_syscall[k]++ == 0) p->since[k] = r->start;
    if (step < 0 && --p->in_syscall[k] == 0) p->busy[k] += r->end - p->since[k];
}

/* Called with the pool's lock held; returns with it held (dropped around the IO itself). */
static void run_one(io_pool* p, io_req* r) {
    r->start = now();
    in_syscall(p, r, +1);
    pthread_mutex_unlock(&p->mu);
    int64_t want = 0;
    for (int i = 0; i < r->niov; i++) want += (int64_t)r->iov[i].iov_len;
    ssize_t got;
    do {
        got = r->write ? pwritev(r->fd, r->iov, r->niov, r->offset) : preadv(r->fd, r->iov, r->niov, r->offset);
    } while (got < 0 && errno == EINTR);
    r->err = got < 0 ? errno : (got != want ? EIO : 0);
    pthread_mutex_lock(&p->mu);
    r->end = now();
    in_syscall(p, r, -1);
    if (r->crcs && !r->err && !r->write) {
        pthread_mutex_unlock(&p->mu);
        checksum(r);
        pthread_mutex_lock(&p->mu);
    }
}

static void* worker(void* arg) {
    io_pool* p = arg;
    int short_slice = p->slice_us > 0 && request_short_slice(p->slice_us);
    pthread_mutex_lock(&p->mu);
    p->short_slice += short_slice;
    for (;;) {
        io_req* r = pop(&p->queue_head, &p->queue_tail);
        if (!r) {
            if (p->closing) break;
            pthread_cond_wait(&p->work, &p->mu);
            continue;
        }
        run_one(p, r);
        push(&p->done_head, &p->done_tail, r);
        pthread_cond_signal(&p->done);
    }
    p->running--;
    pthread_cond_broadcast(&p->done);
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* A pool of num_threads threads (1..64), each asking for a slice of slice_us (0: none); NULL if no
   thread could start. */
void* kvs_io_pool_new(int num_threads, int64_t slice_us) {
    if (num_threads < 1 || num_threads > MAX_THREADS) return NULL;
    io_pool* p = calloc(1, sizeof(io_pool));
    if (!p) return NULL;
    p->slice_us = slice_us;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    pthread_mutex_lock(&p->mu);
    for (int t = 0; t < num_threads; t++) {
        if (pthread_create(&p->threads[p->num_threads], NULL, worker, p) != 0) break;
#ifdef __linux__
        pthread_setname_np(p->threads[p->num_threads], "kvstrata-io");  // as the kernel lists it: ours to tell apart
#endif
        p->num_threads++;
        p->running++;
    }
    pthread_mutex_unlock(&p->mu);
    if (p->num_threads == 0) {
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->work);
        pthread_cond_destroy(&p->done);
        free(p);
        return NULL;
    }
    return p;
}

/* How many of the threads have been granted their short slice so far. */
int kvs_io_pool_short_slice_threads(void* pool) {
    io_pool* p = pool;
    pthread_mutex_lock(&p->mu);
    int n = p->short_slice;
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* Seconds during which at least one read (write = 0) or write (1) was in its syscall, the spell still
   open included: the pool's disk time of that kind, across its threads. */
double kvs_io_pool_busy_seconds(void* pool, int write) {
    io_pool* p = pool;
    int k = write != 0;
    pthread_mutex_lock(&p->mu);
    double s = p->busy[k] + (p->in_syscall[k] ? now() - p->since[k] : 0.0);
    pthread_mutex_unlock(&p->mu);
    return s;
}

/* Queue one IO: write (1) or read (0) of niov buffers (addresses and lengths) at fd's offset. For a
   read, crcs (niov values, or NULL) receives each buffer's CRC-32 of its bytes [crc_offset,
   crc_offset + crc_len) once the whole read succeeded; it must live until the IO is reaped. 0, or
   ESHUTDOWN once closing, ENOMEM, EINVAL for a bad niov or span, or crcs on a write. */
int kvs_io_submit(void* pool, int64_t tag, int fd, int write, int64_t offset, int niov, const int64_t* bases,
                  const int64_t* lens, uint32_t* crcs, int64_t crc_offset, int64_t crc_len) {
    io_pool* p = pool;
    if (niov < 1 || niov > IOV_MAX) return EINVAL;
    if (crcs && (write || crc_offset < 0 || crc_len < 0)) return EINVAL;
    io_req* r = malloc(sizeof(io_req) + (size_t)niov * sizeof(struct iovec));
    if (!r) return ENOMEM;
    r->tag = tag;
    r->fd = fd;
    r->write = write;
    r->offset = offset;
    r->niov = niov;
    r->err = 0;
    r->crcs = crcs;
    r->crc_offset = crc_offset;
    r->crc_len = crc_len;
    for (int i = 0; i < niov; i++) {
        r->iov[i].iov_base = (void*)(intptr_t)bases[i];
        r->iov[i].iov_len = (size_t)lens[i];
    }
    pthread_mutex_lock(&p->mu);
    if (p->closing) {
        pthread_mutex_unlock(&p->mu);
        free(r);
        return ESHUTDOWN;
    }
    push(&p->queue_head, &p->queue_tail, r);
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

/* Up to max finished IOs into tags / errs / times (each IO's start and end, CLOCK_MONOTONIC
   seconds, as Python's time.perf_counter on Linux), waiting up to timeout_s for the first: their
   count, 0 on a timeout, -1 once the pool is closed and everything submitted has been reaped. */
int kvs_io_reap(void* pool, int max, int64_t* tags, int32_t* errs, double* times, double timeout_s) {
    io_pool* p = pool;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    int64_t ns = deadline.tv_nsec + (int64_t)(timeout_s * 1e9);
    deadline.tv_sec += ns / 1000000000;
    deadline.tv_nsec = ns % 1000000000;
    pthread_mutex_lock(&p->mu);
    while (!p->done_head) {
        if (p->closing && p->running == 0) {
            pthread_mutex_unlock(&p->mu);
            return -1;
        }
        if (pthread_cond_timedwait(&p->done, &p->mu, &deadline) == ETIMEDOUT && !p->done_head) {
            pthread_mutex_unlock(&p->mu);
            return 0;
        }
    }
    int n = 0;
    io_req* r;
    while (n < max && (r = pop(&p->done_head, &p->done_tail))) {
        tags[n] = r->tag;
        errs[n] = r->err;
        times[2 * n] = r->start;
        times[2 * n + 1] = r->end;
        n++;
        free(r);
    }
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* Stop taking submissions; the queued IOs still run. Returns at once; kvs_io_pool_free joins. */
void kvs_io_pool_close(void* pool) {
    io_pool* p = pool;
    pthread_mutex_lock(&p->mu);
    p->closing = 1;
    pthread_cond_broadcast(&p->work);
    pthread_cond_broadcast(&p->done);
    pthread_mutex_unlock(&p->mu);
}

/* Close, join the threads and free the pool with any IO not reaped. */
void kvs_io_pool_free(void* pool) {
    io_pool* p = pool;
    kvs_io_pool_close(p);
    for (int t = 0; t < p->num_threads; t++) pthread_join(p->threads[t], NULL);
    io_req* r;
    while ((r = pop(&p->done_head, &p->done_tail))) free(r);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
    free(p);
}
