/* SHA-256 of many small buffers on threads that never take the GIL.
 *
 * hashlib releases the GIL for each buffer it hashes. For 10,000 blocks of 1-16 KiB that is
 * 10,000 hand-overs, and a thread hashing beside a busy Python thread gets the GIL back once per
 * switch interval (5 ms): hashing could not run beside the walk over the state. Here a job (a
 * list of buffers) is queued under a mutex; the pool's threads hash it with OpenSSL, the same
 * SHA-256 hashlib uses, and a thread asking for a result hashes what is left of it (and of the
 * queue's other jobs while it waits).
 *
 * The exporters' buffers are held (PyObject_GetBuffer) from submit until the result is taken or
 * the job is freed; the caller must not change them meanwhile, as with hashlib. Threads touch no
 * Python object. After fork() the child has no pool threads: its jobs are hashed by result().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <string.h>

#define DIGEST 32
#define MAX_THREADS 64
#define CLAIM_BYTES (256 * 1024) /* bytes a thread takes from a job under one lock */

static EVP_MD *sha256;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER;
static pthread_cond_t job_done = PTHREAD_COND_INITIALIZER;
static unsigned long generation; /* bumped in a forked child: earlier jobs have no threads */
static int running;              /* pool threads started in this generation */

typedef struct Job {
    PyObject_HEAD
    Py_buffer *views;
    unsigned char *digests;
    PyObject *prefix;      /* bytes put before each digest */
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

/* Claim up to CLAIM_BYTES of `job`'s buffers; with the lock held. */
static Py_ssize_t claim(Job *job, Py_ssize_t *stop) {
    Py_ssize_t start = job->next, end = start, size = 0;
    while (end < job->count && (end == start || size < CLAIM_BYTES)) size += job->views[end++].len;
    job->next = end;
    if (end == job->count && job->queued) dequeue(job);
    *stop = end;
    return start;
}

/* Hash buffers [start, stop) of `job` (without the lock), then count them done (with it). */
static void hash_claimed(Job *job, Py_ssize_t start, Py_ssize_t stop, EVP_MD_CTX *ctx) {
    int failed = ctx == NULL;
    for (Py_ssize_t i = start; i < stop && !failed; i++) {
        unsigned int size = 0;
        failed = !EVP_DigestInit_ex(ctx, sha256, NULL)
                 || !EVP_DigestUpdate(ctx, job->views[i].buf, (size_t)job->views[i].len)
                 || !EVP_DigestFinal_ex(ctx, job->digests + DIGEST * i, &size);
    }
    pthread_mutex_lock(&lock);
    job->failed |= failed;
    job->unfinished -= stop - start;
    if (job->unfinished == 0) pthread_cond_broadcast(&job_done);
    pthread_mutex_unlock(&lock);
}

static void *worker(void *arg) {
    unsigned long mine = (unsigned long)(uintptr_t)arg;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    pthread_mutex_lock(&lock);
    while (generation == mine) {
        if (queue_head == NULL) { pthread_cond_wait(&work_ready, &lock); continue; }
        Job *job = queue_head;
        Py_ssize_t stop, start = claim(job, &stop);
        pthread_mutex_unlock(&lock);
        hash_claimed(job, start, stop, ctx);
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
    while (job->next < job->count) {
        Py_ssize_t stop, start = claim(job, &stop);
        pthread_mutex_unlock(&lock);
        hash_claimed(job, start, stop, ctx);
        pthread_mutex_lock(&lock);
    }
    while (job->unfinished > 0) {
        if (queue_head == NULL) { pthread_cond_wait(&job_done, &lock); continue; }
        Job *other = queue_head; /* its owner's dealloc waits for this claim: it stays alive */
        Py_ssize_t stop, start = claim(other, &stop);
        pthread_mutex_unlock(&lock);
        hash_claimed(other, start, stop, ctx);
        pthread_mutex_lock(&lock);
    }
    pthread_mutex_unlock(&lock);
    EVP_MD_CTX_free(ctx);
}

static void release_buffers(Job *job) {
    for (Py_ssize_t i = 0; i < job->count; i++) PyBuffer_Release(&job->views[i]);
    PyMem_Free(job->views);
    PyMem_Free(job->digests);
    job->views = NULL;
    job->digests = NULL;
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
     "result() -> list[bytes]: the prefix plus the SHA-256 digest of each buffer, in order.\n"
     "Hashes what no pool thread has taken yet, then waits for the rest, without the GIL."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cas_ckpt._hashpool.Job",
    .tp_basicsize = sizeof(Job),
    .tp_dealloc = (destructor)Job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SHA-256 digests of a list of buffers, hashed by the pool (see submit()).",
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

static PyObject *submit(PyObject *module, PyObject *args) {
    PyObject *buffers, *prefix, *items;
    int threads;
    if (!PyArg_ParseTuple(args, "OSi", &buffers, &prefix, &threads)) return NULL;
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
    job->failed = job->queued = 0;
    job->later = NULL;
    job->generation = 0;
    job->views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    job->digests = PyMem_Malloc(count ? DIGEST * count : 1);
    if (job->views == NULL || job->digests == NULL) {
        PyMem_Free(job->views);
        PyMem_Free(job->digests);
        job->views = NULL;
        Py_DECREF(items);
        Py_DECREF(job);
        return PyErr_NoMemory();
    }
    for (; job->count < count; job->count++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, job->count),
                               &job->views[job->count], PyBUF_SIMPLE) < 0) {
            Py_DECREF(items);
            Py_DECREF(job); /* releases the buffers taken so far */
            return NULL;
        }
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

static PyMethodDef methods[] = {
    {"submit", submit, METH_VARARGS,
     "submit(buffers, prefix: bytes, threads: int) -> Job\n\n"
     "Queue the SHA-256 of each contiguous buffer for the pool, started with up to `threads`\n"
     "threads (0: none; the job's result() then hashes them all on its own thread)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hashpool",
    .m_doc = "SHA-256 of many buffers on threads that never take the GIL (see cas_ckpt.cid).",
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
    }
    return PyModule_Create(&module);
}
