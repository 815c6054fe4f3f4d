/* kvd_client.dataplane._copy: a copy plan's runs moved host to host in one call, the GIL
 * released (kvd_client/dataplane/cpu.py; its Python twin there moves each run with
 * ctypes.memmove, the same bytes).
 *
 *   copy_runs(src, dst, lengths, threads=1) -> bytes moved
 *       src, dst, lengths: buffers of 64-bit integers of one length (a CopyPlan's arrays):
 *       run i copies lengths[i] bytes from address src[i] to address dst[i]. No destination
 *       may overlap another run's bytes or its own source (a plan's never do: pool slots and
 *       an engine's pages). `threads` (1..16): a call
 *       of at least SHARE_MIN bytes a thread is cut into that many equal shares of bytes (a
 *       run may be cut too), each copied by a thread of its own started for the call (the
 *       calling thread copies the first): one thread streams ~8 GB/s, two ~14 on the test VM,
 *       where memory, not the core, is the limit. A thread that cannot start leaves its share
 *       to the calling thread.
 *
 * Why not memcpy alone: a copy between the pool and an engine's pages reads and writes memory
 * no cache holds (the pool is GBs; a batch is MBs). memcpy's ordinary stores first read each
 * destination line into the cache, then write it back: ~5.4 GB/s on a 2-core test VM. Where a
 * call moves at least STREAM_MIN_TOTAL bytes, runs of STREAM_MIN_RUN bytes and more are copied
 * with non-temporal stores instead (SSE2, every x86-64 has it), which skip that read: ~8 GB/s
 * on the same VM (bench/sglang.py; glibc's memcpy does the same only above its
 * x86_non_temporal_threshold, ~180 MiB there, one call's whole size). Elsewhere, and for small
 * calls (whose bytes the engine reads next, from the cache), it is memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define STREAM_MIN_TOTAL (1 << 20)     /* a call of 1 MiB or more ... */
#define STREAM_MIN_RUN (4 << 10)       /* ... streams its runs of 4 KiB or more */
#define SHARE_MIN (4 << 20)            /* a thread of its own for each 4 MiB, up to `threads` */
#define MAX_THREADS 16

#if HAVE_STREAM
/* n bytes from s to d: ordinary stores up to d's 16-byte alignment and for the tail,
 * non-temporal 16-byte stores between (four a loop: one cache line). */
static void stream_copy(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
}
#endif

/* One thread's share of a call: the bytes [begin, end) of the runs laid end to end. */
typedef struct {
    const int64_t *src, *dst, *len;
    Py_ssize_t runs;
    uint64_t begin, end;
    int stream;
} Share;

static void copy_share(const Share *w) {
    uint64_t at = 0;                  /* where run i starts among the runs laid end to end */
    for (Py_ssize_t i = 0; i < w->runs && at < w->end; at += (uint64_t)w->len[i], i++) {
        uint64_t n = (uint64_t)w->len[i];
        if (at + n <= w->begin) continue;
        uint64_t from = w->begin > at ? w->begin - at : 0;
        uint64_t to = w->end < at + n ? w->end - at : n;
        char *d = (char *)(intptr_t)w->dst[i] + from;
        const char *s = (const char *)(intptr_t)w->src[i] + from;
#if HAVE_STREAM
        if (w->stream && n >= STREAM_MIN_RUN) {
            stream_copy(d, s, (size_t)(to - from));
            continue;
        }
#endif
        memmove(d, s, (size_t)(to - from));
    }
#if HAVE_STREAM
    if (w->stream) _mm_sfence();      /* this thread's streamed stores visible when it ends */
#endif
}

static void *share_thread(void *arg) {
    copy_share((const Share *)arg);
    return NULL;
}

static int as_words(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->ndim > 1) {
        PyErr_Format(PyExc_TypeError, "copy_runs: %s must hold 64-bit integers", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_runs(src, dst, lengths, threads=1)");
        return NULL;
    }
    long threads = 1;
    if (nargs == 4) {
        threads = PyLong_AsLong(args[3]);
        if (threads == -1 && PyErr_Occurred()) return NULL;
        if (threads < 1 || threads > MAX_THREADS) {
            PyErr_Format(PyExc_ValueError, "copy_runs: threads must be 1..%d", MAX_THREADS);
            return NULL;
        }
    }
    Py_buffer src, dst, len;
    if (as_words(args[0], &src, "src") < 0) return NULL;
    if (as_words(args[1], &dst, "dst") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (as_words(args[2], &len, "lengths") < 0) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = len.len / 8;
    if (src.len != len.len || dst.len != len.len) {
        PyErr_SetString(PyExc_ValueError, "copy_runs: src, dst and lengths differ in length");
        goto done;
    }
    const int64_t *s = src.buf, *d = dst.buf, *l = len.buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (l[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_runs: a negative length");
            goto done;
        }
        total += (uint64_t)l[i];
    }
    uint64_t most = total / SHARE_MIN;
    int shares = (uint64_t)threads < most ? (int)threads : (most ? (int)most : 1);
    Share work[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int k = 0; k < shares; k++)
        work[k] = (Share){s, d, l, n, total * (uint64_t)k / (uint64_t)shares,
                          total * (uint64_t)(k + 1) / (uint64_t)shares,
                          total >= STREAM_MIN_TOTAL};
    Py_BEGIN_ALLOW_THREADS
    for (int k = 1; k < shares; k++)
        started[k] = pthread_create(&ids[k], NULL, share_thread, &work[k]) == 0;
    copy_share(&work[0]);
    for (int k = 1; k < shares; k++) {
        if (started[k])
            pthread_join(ids[k], NULL);
        else
            copy_share(&work[k]);
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(total);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&len);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_runs", (PyCFunction)(void (*)(void))copy_runs, METH_FASTCALL,
     "copy_runs(src, dst, lengths, threads=1) -> bytes moved: a copy plan's runs, the GIL "
     "released, large calls shared among threads "
     "(kvd_client/dataplane/_copy.c)"},
    {NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvd_client.dataplane._copy",
    "A copy plan's runs moved host to host in one call (Python twin: "
    "kvd_client/dataplane/cpu.py).", -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "STREAM_MIN_TOTAL", STREAM_MIN_TOTAL) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_MIN_RUN", STREAM_MIN_RUN) < 0 ||
        PyModule_AddIntConstant(m, "SHARE_MIN", SHARE_MIN) < 0 ||
        PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "STREAMS", HAVE_STREAM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
