/* SHA-256 or BLAKE3 of many small buffers on threads that never take the GIL.
 *
 * hashlib releases the GIL for each buffer it hashes. For 10,000 blocks of 1-16 KiB that is
 * 10,000 hand-overs, and a thread hashing beside a busy Python thread gets the GIL back once per
 * switch interval (5 ms): hashing could not run beside the walk over the state. Here a job (a
 * list of buffers) is queued under a mutex; the pool's threads hash it with OpenSSL, the same
 * SHA-256 hashlib uses, and a thread asking for a result hashes what is left of it (and of the
 * queue's other jobs while it waits). A job of a blake3 repository is hashed the same way with
 * BLAKE3's official C code (vendor/blake3: its SIMD code, picked for the CPU at run time, hashes
 * a buffer's 1 KiB chunks 4-16 at a time, so one large buffer is already parallel in lanes).
 *
 * The exporters' buffers are held (PyObject_GetBuffer) from submit until the result is taken or
 * the job is freed; the caller must not change them meanwhile, as with hashlib. Threads touch no
 * Python object. After fork() the child has no pool threads: its jobs are hashed by result().
 *
 * A job may also fill its buffers first, from one source holding their bytes back to back (a
 * run of blocks in a pack's mapping): a thread populates a buffer's pages, copies its bytes a
 * piece at a time and hashes each piece while it is in cache. A load's chunks are then read
 * and checked with no Python call per chunk, no GIL and no task hand-over.
 *
 * Where the CPU has AVX-512, a thread about to take a buffer of 64 KiB or more takes instead up
 * to 16 of that length, from its job and the jobs queued after it, and hashes them at once, one
 * per vector lane (claim_group, do_group, _sha256_x16.c): a save queues one job per chunk.
 * It takes the shorter buffers of a job (a load's or a save's small arrays) a megabyte at a
 * time and hashes them 16 lanes at once too, whatever their lengths: a lane that finishes one
 * takes the next (do_mixed, x16_many).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "_sha256_x16.h"
#include "blake3.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define DIGEST 32
#define SHA2_256 0x12 /* a job's hash, by its multihash code */
#define BLAKE3 0x1e
#define MAX_THREADS 64
#define CLAIM_BYTES (256 * 1024) /* bytes a thread takes from a job under one lock */
#define PIECE (64 * 1024)         /* bytes copied, then hashed while in cache */
#define GROUP_MIN_LEN (64 * 1024) /* buffers this long and of one length are hashed 16 at once */
#define GROUP_MIN 10              /* fewer buffers of a length are hashed one by one: 16 lanes
                                     cost what 16 buffers do, 1.6-1.7 times one OpenSSL hash */
#define GROUP_PIECE (16 * 1024)   /* a grouped buffer's bytes copied per step: 16 lanes in L2 */
#define MIXED_MIN 8               /* a claim of fewer buffers below GROUP_MIN_LEN is hashed
                                     one by one; of more, 16 lanes at a time (x16_many) */
#define MIXED_BYTES (1024 * 1024) /* such a claim's bytes: its lanes idle only at its end */

static EVP_MD *sha256;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER;
static pthread_cond_t job_done = PTHREAD_COND_INITIALIZER;
static unsigned long generation; /* bumped in a forked child: earlier jobs have no threads */
static int running;              /* pool threads started in this generation */
static int populate = 1;         /* MADV_POPULATE_WRITE works here (Linux 5.14 and later) */
static long page_size = 4096;
static int grouping;             /* x16_available(): buffers of one length hashed 16 at once */
static unsigned long long grouped; /* buffers hashed in groups so far (for the tests) */
static unsigned long long mixed;   /* and short ones hashed 16 lanes at a time (do_mixed) */
static unsigned long long blake3_hashed; /* buffers hashed with BLAKE3 (for the tests) */

typedef struct Job {
    PyObject_HEAD
    Py_buffer *views;
    unsigned char *digests;
    PyObject *prefix;      /* bytes put before each digest; None: copy only, no hashing */
    Py_buffer source;      /* with `filling`: the buffers' bytes back to back */
    Py_ssize_t *starts;    /* with `filling`: where each buffer's bytes begin in `source` */
    int filling;
    int hash;              /* SHA2_256 or BLAKE3 */
    Py_ssize_t count;      /* buffers */
    Py_ssize_t next;       /* first buffer nobody has claimed */
    Py_ssize_t unfinished; /* buffers claimed or not, not yet hashed */
    int failed;
    int queued;
    unsigned long generation;
    struct Job *later; /* the queue, oldest first */
} Job;

static Job *queue_head, *queue_tail;

static void dequeue(Job *job) { /* with the lock held */
    Job **at = &queue_head, *before = NULL;
    while (*at != NULL && *at != job) { before = *at; at = &(*at)->later; }
    if (*at == NULL) return;
    *at = job->later;
    if (queue_tail == job) queue_tail = before;
    job->queued = 0;
    job->later = NULL;
}

/* What one thread took under the lock: a range of one job's buffers, or a group of buffers
 * of one length from the queue's jobs (hashed 16 at once). */
typedef struct {
    Job *job;
    Py_ssize_t start, stop; /* the range, when `lanes` is 0 */
    int lanes;
    Job *jobs[X16_LANES];
    Py_ssize_t index[X16_LANES];
} Claim;

/* The jobs a group may take buffers from, `first` first, then the queue; with the lock held. */
static Job *next_candidate(Job *first, Job *at) {
    Job *next = at == first ? queue_head : at->later;
    return next == first ? next->later : next;
}

/* Whether `job` hashes with SHA-256 (the only hash the 16 lanes of _sha256_x16.c do). */
static int sha256_job(const Job *job) { return job->digests != NULL && job->hash == SHA2_256; }

/* A job a group may take buffers from: one that hashes SHA-256, of this generation (see finish). */
static int groupable(const Job *job) { return sha256_job(job) && job->generation == generation; }

/* Buffers of length `len`, up to 16, that a group led by `job` could take; with the lock held. */
static int group_size(Job *job, Py_ssize_t len) {
    int lanes = 0;
    for (Job *at = job; at != NULL && lanes < X16_LANES; at = next_candidate(job, at)) {
        if (!groupable(at)) continue;
        for (Py_ssize_t i = at->next; i < at->count && lanes < X16_LANES && at->views[i].len == len; i++)
            lanes++;
    }
    return lanes;
}

/* Claim a group led by `job`'s next buffer if enough of one length are waiting; with the lock
 * held. Each job gives its next buffers in order, so claims stay ranges from `next` on. */
static int claim_group(Job *job, Claim *claim) {
    if (!grouping || !groupable(job) || job->next >= job->count) return 0;
    Py_ssize_t len = job->views[job->next].len;
    if (len < GROUP_MIN_LEN || group_size(job, len) < GROUP_MIN) return 0;
    int lanes = 0;
    Job *at = job;
    while (at != NULL && lanes < X16_LANES) {
        Job *after = next_candidate(job, at); /* before `at` can leave the queue */
        if (groupable(at)) {
            while (at->next < at->count && lanes < X16_LANES && at->views[at->next].len == len) {
                claim->jobs[lanes] = at;
                claim->index[lanes++] = at->next++;
            }
            if (at->next == at->count && at->queued) dequeue(at);
        }
        at = after;
    }
    claim->lanes = lanes;
    return 1;
}

/* Claim a group (see claim_group), else up to CLAIM_BYTES of `job`'s buffers; with the lock held. */
static void claim(Job *job, Claim *claim) {
    claim->job = job;
    claim->lanes = 0;
    if (claim_group(job, claim)) return;
    Py_ssize_t start = job->next, end = start, size = 0;
    if (grouping && sha256_job(job) && job->views[start].len < GROUP_MIN_LEN) {
        /* short buffers, for do_mixed: up to the next long one */
        while (end < job->count && size < MIXED_BYTES && job->views[end].len < GROUP_MIN_LEN)
            size += job->views[end++].len;
    } else {
        while (end < job->count && (end == start || size < CLAIM_BYTES)) size += job->views[end++].len;
    }
    job->next = end;
    if (end == job->count && job->queued) dequeue(job);
    claim->start = start;
    claim->stop = end;
}

/* Make the whole pages of [buf, buf + len) resident at once rather than fault them one by one
 * under the copy (a page fault is dear in a VM). Without the GIL, like everything here. */
static void populate_pages(char *buf, Py_ssize_t len) {
    uintptr_t start = ((uintptr_t)buf + page_size - 1) / page_size * page_size;
    uintptr_t end = ((uintptr_t)buf + len) / page_size * page_size;
    if (populate && end > start + page_size
        && madvise((void *)start, end - start, MADV_POPULATE_WRITE) != 0
        && (errno == EINVAL || errno == ENOSYS))
        populate = 0; /* an older kernel: every later call would fail the same way */
}

/* The hash of one buffer as it is filled: OpenSSL's SHA-256 or BLAKE3's, or none (a job
 * that only copies). Each call 1 on success, 0 where OpenSSL failed. */
typedef struct {
    int hash; /* 0: none */
    EVP_MD_CTX *ctx;
    blake3_hasher blake3;
} Digest;

static int digest_init(Digest *d) {
    if (d->hash == BLAKE3) { blake3_hasher_init(&d->blake3); return 1; }
    return d->hash == 0 || (d->ctx != NULL && EVP_DigestInit_ex(d->ctx, sha256, NULL));
}

static int digest_update(Digest *d, const void *data, size_t len) {
    if (d->hash == BLAKE3) { blake3_hasher_update(&d->blake3, data, len); return 1; }
    return d->hash == 0 || EVP_DigestUpdate(d->ctx, data, len);
}

static int digest_final(Digest *d, unsigned char *out) {
    unsigned int size = 0;
    if (d->hash == BLAKE3) { blake3_hasher_finalize(&d->blake3, out, DIGEST); return 1; }
    return d->hash == 0 || EVP_DigestFinal_ex(d->ctx, out, &size);
}

/* Ask the kernel to read [buf, buf + len) ahead, where it is a file's mapping whose pages are
 * not all in the page cache (a cold load): the whole run of blocks is read in large requests
 * while the threads copy its first pieces, instead of a fault and a readahead window at a time.
 * For pages already cached, or anonymous memory, it costs a walk of the range. */
static void advise_willneed(const void *buf, Py_ssize_t len) {
    uintptr_t start = (uintptr_t)buf / page_size * page_size;
    uintptr_t end = (uintptr_t)buf + (uintptr_t)len;
    if (len > 0) madvise((void *)start, end - start, MADV_WILLNEED); /* a hint: errors change nothing */
}

/* Buffer i of `job`: filled from its source first if the job fills, then hashed. */
static int do_buffer(Job *job, Py_ssize_t i, EVP_MD_CTX *ctx) {
    char *buf = job->views[i].buf;
    Py_ssize_t len = job->views[i].len;
    Digest d; /* not zeroed: BLAKE3's hasher is 1.9 KiB, and digest_init sets what is used */
    d.hash = job->digests == NULL ? 0 : job->hash;
    d.ctx = ctx;
    if (!digest_init(&d)) return 0;
    if (job->filling) {
        const char *from = (const char *)job->source.buf + job->starts[i];
        populate_pages(buf, len);
        for (Py_ssize_t done = 0; done < len; done += PIECE) {
            size_t piece = (size_t)(len - done < PIECE ? len - done : PIECE);
            memcpy(buf + done, from + done, piece);
            if (!digest_update(&d, buf + done, piece)) return 0;
        }
    } else if (!digest_update(&d, buf, (size_t)len)) {
        return 0;
    }
    return digest_final(&d, job->digests == NULL ? NULL : job->digests + DIGEST * i);
}

/* A group's buffers, filled first where their jobs fill, hashed 16 at once. A lane past the
 * group's size repeats the first buffer, and its digest goes nowhere. */
static void do_group(Claim *claim) {
    const unsigned char *lane[X16_LANES];
    unsigned char *out[X16_LANES];
    Py_ssize_t len = claim->jobs[0]->views[claim->index[0]].len;
    for (int j = 0; j < X16_LANES; j++) {
        int used = j < claim->lanes;
        Job *job = claim->jobs[used ? j : 0];
        Py_ssize_t i = claim->index[used ? j : 0];
        lane[j] = job->views[i].buf;
        out[j] = used ? job->digests + DIGEST * i : NULL;
        if (used && job->filling) populate_pages(job->views[i].buf, len);
    }
    X16State state;
    x16_init(&state);
    for (Py_ssize_t done = 0; done < len; done += GROUP_PIECE) {
        size_t piece = (size_t)(len - done < GROUP_PIECE ? len - done : GROUP_PIECE);
        for (int j = 0; j < claim->lanes; j++) {
            Job *job = claim->jobs[j];
            Py_ssize_t i = claim->index[j];
            if (job->filling)
                memcpy((char *)job->views[i].buf + done, (const char *)job->source.buf + job->starts[i] + done, piece);
        }
        x16_blocks(&state, lane, (size_t)done, piece / 64);
    }
    x16_final(&state, lane, (size_t)len, out);
}

typedef struct { size_t len, index; } Sized;

static int longest_first(const void *a, const void *b) {
    size_t x = ((const Sized *)a)->len, y = ((const Sized *)b)->len;
    return x < y ? 1 : x > y ? -1 : 0;
}

typedef struct { Job *job; Py_ssize_t start; } Range;

/* x16_many's `started`: fill the buffer from the job's source just before its lane reads it. */
static void fill_started(void *arg, size_t b) {
    const Range *range = arg;
    Py_buffer *view = &range->job->views[range->start + (Py_ssize_t)b];
    populate_pages(view->buf, view->len);
    memcpy(view->buf, (const char *)range->job->source.buf + range->job->starts[range->start + (Py_ssize_t)b],
           (size_t)view->len);
}

/* A range of MIXED_MIN or more buffers, each below GROUP_MIN_LEN, of a job that hashes: hashed
 * 16 lanes at a time, longest first, so that the lanes run out of work at about the same
 * moment. 0 if it is not such a range (or memory ran out): then hash it one by one. */
static int do_mixed(Claim *claim) {
    Job *job = claim->job;
    size_t n = (size_t)(claim->stop - claim->start);
    if (!grouping || !sha256_job(job) || n < MIXED_MIN) return 0;
    for (Py_ssize_t i = claim->start; i < claim->stop; i++)
        if (job->views[i].len >= GROUP_MIN_LEN) return 0;
    Sized *sized = malloc(n * sizeof(Sized));
    const unsigned char **p = malloc(n * sizeof(*p));
    size_t *len = malloc(n * sizeof(size_t)), *order = malloc(n * sizeof(size_t));
    unsigned char **out = malloc(n * sizeof(*out));
    int done = sized != NULL && p != NULL && len != NULL && order != NULL && out != NULL;
    if (done) {
        for (size_t b = 0; b < n; b++) {
            Py_ssize_t i = claim->start + (Py_ssize_t)b;
            p[b] = job->views[i].buf;
            len[b] = (size_t)job->views[i].len;
            out[b] = job->digests + DIGEST * i;
            sized[b] = (Sized){len[b], b};
        }
        qsort(sized, n, sizeof(Sized), longest_first);
        for (size_t b = 0; b < n; b++) order[b] = sized[b].index;
        Range range = {job, claim->start};
        x16_many(p, len, order, n, out, job->filling ? fill_started : NULL, &range);
    }
    free(sized);
    free(p);
    free(len);
    free(order);
    free(out);
    return done;
}

/* Do what was claimed (without the lock), then count it done (with it). */
static void hash_claimed(Claim *claim, EVP_MD_CTX *ctx) {
    int failed = 0, in_lanes = 0;
    if (claim->lanes > 0) {
        do_group(claim);
    } else if (!(in_lanes = do_mixed(claim))) {
        for (Py_ssize_t i = claim->start; i < claim->stop && !failed; i++) failed = !do_buffer(claim->job, i, ctx);
    }
    pthread_mutex_lock(&lock);
    if (claim->lanes > 0) {
        grouped += (unsigned long long)claim->lanes;
        for (int j = 0; j < claim->lanes; j++)
            if (--claim->jobs[j]->unfinished == 0) pthread_cond_broadcast(&job_done);
    } else {
        if (in_lanes) mixed += (unsigned long long)(claim->stop - claim->start);
        if (claim->job->digests != NULL && claim->job->hash == BLAKE3)
            blake3_hashed += (unsigned long long)(claim->stop - claim->start);
        claim->job->failed |= failed;
        claim->job->unfinished -= claim->stop - claim->start;
        if (claim->job->unfinished == 0) pthread_cond_broadcast(&job_done);
    }
    pthread_mutex_unlock(&lock);
}

static void *worker(void *arg) {
    unsigned long mine = (unsigned long)(uintptr_t)arg;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    pthread_mutex_lock(&lock);
    while (generation == mine) {
        if (queue_head == NULL) { pthread_cond_wait(&work_ready, &lock); continue; }
        Claim taken;
        claim(queue_head, &taken);
        pthread_mutex_unlock(&lock);
        hash_claimed(&taken, ctx);
        pthread_mutex_lock(&lock);
    }
    pthread_mutex_unlock(&lock);
    EVP_MD_CTX_free(ctx);
    return NULL;
}

/* fork() with the lock held, so that the child's copy of the queue is whole. */
static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork_in_parent(void) { pthread_mutex_unlock(&lock); }

static void after_fork_in_child(void) {
    for (Job *job = queue_head; job != NULL; job = job->later) job->queued = 0;
    queue_head = queue_tail = NULL; /* each job there is hashed by its result() */
    generation++;
    running = 0;
    pthread_cond_init(&work_ready, NULL);
    pthread_cond_init(&job_done, NULL);
    pthread_mutex_unlock(&lock);
}

/* Claim and hash what is left of `job` on this thread; while the pool's threads finish its
 * last claims, hash the queue's other jobs rather than sleep (a job of one large buffer would
 * otherwise leave this core idle while one thread hashes it). No GIL held. */
static void finish(Job *job) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    pthread_mutex_lock(&lock);
    if (job->generation != generation) { /* forked: its claims died with the parent's threads */
        job->generation = generation;
        job->queued = 0;
        if (job->unfinished > 0) { /* which claims were done is not known: hash them all */
            job->next = 0;
            job->unfinished = job->count;
        }
    }
    Claim taken;
    while (job->next < job->count) {
        claim(job, &taken);
        pthread_mutex_unlock(&lock);
        hash_claimed(&taken, ctx);
        pthread_mutex_lock(&lock);
    }
    while (job->unfinished > 0) {
        if (queue_head == NULL) { pthread_cond_wait(&job_done, &lock); continue; }
        claim(queue_head, &taken); /* their owners' deallocs wait for this claim: they stay alive */
        pthread_mutex_unlock(&lock);
        hash_claimed(&taken, ctx);
        pthread_mutex_lock(&lock);
    }
    pthread_mutex_unlock(&lock);
    EVP_MD_CTX_free(ctx);
}

static void release_buffers(Job *job) {
    for (Py_ssize_t i = 0; i < job->count; i++) PyBuffer_Release(&job->views[i]);
    if (job->filling) PyBuffer_Release(&job->source);
    PyMem_Free(job->views);
    PyMem_Free(job->digests);
    PyMem_Free(job->starts);
    job->views = NULL;
    job->digests = NULL;
    job->starts = NULL;
    job->filling = 0;
    job->count = job->next = job->unfinished = 0;
}

static PyObject *Job_result(Job *job, PyObject *unused) {
    if (job->views == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the result of this hash job was already taken");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    finish(job);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (job->views == NULL) { /* another thread took it while this one waited */
        PyErr_SetString(PyExc_RuntimeError, "the result of this hash job was already taken");
    } else if (job->failed) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL's SHA-256 failed");
    } else if (job->digests == NULL) {
        Py_INCREF(Py_None); /* a job that only copies */
        out = Py_None;
    } else if ((out = PyList_New(job->count)) != NULL) {
        const char *head = PyBytes_AS_STRING(job->prefix);
        Py_ssize_t size = PyBytes_GET_SIZE(job->prefix);
        for (Py_ssize_t i = 0; i < job->count; i++) {
            PyObject *cid = PyBytes_FromStringAndSize(NULL, size + DIGEST);
            if (cid == NULL) { Py_CLEAR(out); break; }
            memcpy(PyBytes_AS_STRING(cid), head, size);
            memcpy(PyBytes_AS_STRING(cid) + size, job->digests + DIGEST * i, DIGEST);
            PyList_SET_ITEM(out, i, cid);
        }
    }
    if (job->views != NULL) release_buffers(job);
    return out;
}

static void Job_dealloc(Job *job) {
    if (job->views != NULL) {
        /* Nobody took the result (a failed save): stop what is unclaimed, wait for the rest. */
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&lock);
        if (job->queued) dequeue(job);
        if (job->generation == generation) {
            job->unfinished -= job->count - job->next;
            job->next = job->count;
            while (job->unfinished > 0) pthread_cond_wait(&job_done, &lock);
        }
        pthread_mutex_unlock(&lock);
        Py_END_ALLOW_THREADS
        release_buffers(job);
    }
    Py_XDECREF(job->prefix);
    Py_TYPE(job)->tp_free((PyObject *)job);
}

static PyMethodDef Job_methods[] = {
    {"result", (PyCFunction)Job_result, METH_NOARGS,
     "result() -> list[bytes] | None: the prefix plus the digest of each buffer, in\n"
     "order (None for a job that only copies).\n"
     "Hashes what no pool thread has taken yet, then waits for the rest, without the GIL."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cas_ckpt._hashpool.Job",
    .tp_basicsize = sizeof(Job),
    .tp_dealloc = (destructor)Job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SHA-256 or BLAKE3 digests of a list of buffers, hashed by the pool (see submit()).",
    .tp_methods = Job_methods,
};

static int start_threads(int wanted) { /* with the lock held */
    for (; running < wanted; running++) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, worker, (void *)(uintptr_t)generation);
        pthread_attr_destroy(&attr);
        if (failed) return running > 0 ? 0 : -1; /* result() hashes on the caller anyway */
    }
    return 0;
}

/* Take `buffers` into `job`, and `source` if not NULL: writable buffers then, whose sizes
 * add up to the source's. 0 on success; -1 with an exception set. */
static int take_buffers(Job *job, PyObject *items, PyObject *source) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items), total = 0;
    int flags = source == NULL ? PyBUF_SIMPLE : PyBUF_WRITABLE;
    for (; job->count < count; job->count++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, job->count),
                               &job->views[job->count], flags) < 0)
            return -1;
    }
    if (source == NULL) return 0;
    if ((job->starts = PyMem_Malloc(count ? count * sizeof(Py_ssize_t) : 1)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        job->starts[i] = total;
        total += job->views[i].len;
    }
    if (PyObject_GetBuffer(source, &job->source, PyBUF_SIMPLE) < 0) return -1;
    job->filling = 1;
    advise_willneed(job->source.buf, job->source.len);
    if (job->source.len != total) {
        PyErr_Format(PyExc_ValueError, "the source holds %zd bytes, the buffers %zd",
                     job->source.len, total);
        return -1;
    }
    return 0;
}

static PyObject *submit(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"buffers", "prefix", "threads", "source", "hash", NULL};
    PyObject *buffers, *prefix, *items, *source = Py_None;
    int threads, hash = SHA2_256;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOi|Oi", keywords, &buffers, &prefix, &threads,
                                     &source, &hash))
        return NULL;
    if (hash != SHA2_256 && hash != BLAKE3) {
        PyErr_Format(PyExc_ValueError, "hash must be 0x%x (sha2-256) or 0x%x (blake3)", SHA2_256, BLAKE3);
        return NULL;
    }
    if (prefix != Py_None && !PyBytes_Check(prefix)) {
        PyErr_SetString(PyExc_TypeError, "prefix must be bytes or None");
        return NULL;
    }
    if (prefix == Py_None && source == Py_None) {
        PyErr_SetString(PyExc_ValueError, "a job without a prefix only copies: it needs a source");
        return NULL;
    }
    if (threads < 0 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be between 0 and %d", MAX_THREADS);
        return NULL;
    }
    if ((items = PySequence_Fast(buffers, "buffers must be a sequence")) == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    Job *job = PyObject_New(Job, &JobType);
    if (job == NULL) { Py_DECREF(items); return NULL; }
    Py_INCREF(prefix);
    job->prefix = prefix;
    job->count = job->next = job->unfinished = 0;
    job->failed = job->queued = job->filling = 0;
    job->hash = hash;
    job->later = NULL;
    job->generation = 0;
    job->starts = NULL;
    job->views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    job->digests = prefix == Py_None ? NULL : PyMem_Malloc(count ? DIGEST * count : 1);
    if (job->views == NULL || (prefix != Py_None && job->digests == NULL)) {
        PyMem_Free(job->views);
        PyMem_Free(job->digests);
        job->views = NULL;
        Py_DECREF(items);
        Py_DECREF(job);
        return PyErr_NoMemory();
    }
    if (take_buffers(job, items, source == Py_None ? NULL : source) < 0) {
        Py_DECREF(items);
        Py_DECREF(job); /* releases the buffers taken so far */
        return NULL;
    }
    Py_DECREF(items);
    job->unfinished = count;
    pthread_mutex_lock(&lock);
    job->generation = generation;
    if (count > 0 && threads > 0 && start_threads(threads) == 0) {
        job->queued = 1;
        if (queue_tail == NULL) queue_head = job;
        else queue_tail->later = job;
        queue_tail = job;
        pthread_cond_broadcast(&work_ready);
    }
    pthread_mutex_unlock(&lock);
    return (PyObject *)job;
}

static PyObject *grouped_count(PyObject *module, PyObject *unused) {
    pthread_mutex_lock(&lock);
    unsigned long long count = grouped;
    pthread_mutex_unlock(&lock);
    return PyLong_FromUnsignedLongLong(count);
}

static PyObject *mixed_count(PyObject *module, PyObject *unused) {
    pthread_mutex_lock(&lock);
    unsigned long long count = mixed;
    pthread_mutex_unlock(&lock);
    return PyLong_FromUnsignedLongLong(count);
}

static PyObject *blake3_count(PyObject *module, PyObject *unused) {
    pthread_mutex_lock(&lock);
    unsigned long long count = blake3_hashed;
    pthread_mutex_unlock(&lock);
    return PyLong_FromUnsignedLongLong(count);
}

static PyMethodDef methods[] = {
    {"grouped", grouped_count, METH_NOARGS,
     "grouped() -> int: buffers this process has hashed 16 at once (GROUPING: where it can)."},
    {"mixed", mixed_count, METH_NOARGS,
     "mixed() -> int: buffers below 64 KiB, of any lengths, this process has hashed 16 lanes\n"
     "at a time (GROUPING: where it can)."},
    {"blake3_hashed", blake3_count, METH_NOARGS,
     "blake3_hashed() -> int: buffers this process has hashed with BLAKE3 on the pool."},
    {"submit", (PyCFunction)(void (*)(void))submit, METH_VARARGS | METH_KEYWORDS,
     "submit(buffers, prefix: bytes | None, threads: int, source=None, hash=SHA2_256) -> Job\n\n"
     "Queue the hash (SHA2_256 or BLAKE3, by multihash code) of each contiguous buffer for the\n"
     "pool, started with up to `threads` threads (0: none; the job's result() then hashes them\n"
     "all on its own thread).\n"
     "With `source` (the buffers' bytes back to back), each writable buffer is first filled\n"
     "from its part of it; a prefix of None then copies without hashing."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hashpool",
    .m_doc = "SHA-256 or BLAKE3 of many buffers on threads that never take the GIL (see cas_ckpt.cid).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__hashpool(void) {
    if (PyType_Ready(&JobType) < 0) return NULL;
    if (sha256 == NULL) {
        sha256 = EVP_MD_fetch(NULL, "SHA256", NULL);
        if (sha256 == NULL) {
            PyErr_SetString(PyExc_ImportError, "OpenSSL provides no SHA256");
            return NULL;
        }
        pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
        page_size = sysconf(_SC_PAGESIZE);
        grouping = x16_available();
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "GROUPING", grouping) < 0
                      || PyModule_AddIntConstant(m, "SHA2_256", SHA2_256) < 0
                      || PyModule_AddIntConstant(m, "BLAKE3", BLAKE3) < 0
                      || PyModule_AddStringConstant(m, "BLAKE3_VERSION", blake3_version()) < 0))
        Py_CLEAR(m);
    return m;
}
