/* kvd_server.tiers.disk._blockio: the disk tier's block writes and reads, a batch per call, with the GIL
 * released for the whole batch (kvd_server/tiers/disk/block_io.py has the pure-Python twin).
 *
 * Why: the tier's I/O threads are Python threads. Done block by block in Python, each block
 * gives the GIL up twice (the system call, the CRC) and must win it back from the daemon's
 * event loop each time; under load that wait, not the drive, bounds the tier (bench/tiers.py
 * measured 30-55% of the drive's bandwidth). Here a thread takes the GIL once per batch.
 *
 * The checksum is zlib's CRC-32 (the same value as Python's zlib.crc32, so the tier's journal
 * and files do not depend on which path wrote them), called from libz.so.1 (loaded at import;
 * without it the import fails and the tier runs on the twin). On x86-64 CPUs with PCLMULQDQ
 * (checked at import) the bulk of each block is folded with carry-less multiplies instead
 * (Gopal et al., "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", Intel 2009;
 * the constants of its appendix for the reflected 0x04C11DB7 polynomial): zlib 1.2.13's table
 * code ran at ~3 GB/s, a third of the daemon's CPU while demoting (perf); this runs at over
 * 10 GB/s. The tail that is not a multiple of 16 bytes goes through zlib.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_VECTOR 64                 /* blocks in one request, at most (IoBatches' batch) */
#define MAX_VECTOR_BYTES (16LL << 20)  /* bytes in one request, at most */

typedef unsigned long (*zlib_crc32_fn)(unsigned long, const unsigned char *, unsigned int);
static zlib_crc32_fn zlib_crc32 = NULL;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_CLMUL_CODE 1
static int use_clmul = 0;

/* The CRC register (not inverted) after `n` bytes (n >= 64, a multiple of 16) from `crc`. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_clmul(uint32_t crc, const unsigned char *buf, size_t len) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

    x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    x0 = k1k2;
    buf += 64;
    len -= 64;
    while (len >= 64) {                       /* fold four lanes of 128 bits at a time */
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }
    x0 = k3k4;                                /* the four lanes into one */
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) {                       /* what is left, 16 bytes at a time */
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);  /* 128 bits to 64 */
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x0 = k5k0;
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    x0 = poly;                                /* Barrett reduction to 32 bits */
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

static uint32_t crc32_of(uint32_t crc, const unsigned char *p, size_t n) {
#ifdef HAVE_CLMUL_CODE
    if (use_clmul && n >= 64) {
        size_t bulk = n & ~(size_t)15;
        crc = ~crc32_clmul(~crc, p, bulk);
        p += bulk;
        n -= bulk;
    }
#endif
    while (n) {
        unsigned int chunk = n > (1u << 30) ? (1u << 30) : (unsigned int)n;
        crc = (uint32_t)zlib_crc32(crc, p, chunk);
        p += chunk;
        n -= chunk;
    }
    return crc;
}

/* All of `n` bytes at `off`: 0, or -errno (a write the drive takes none of: -ENOSPC). */
static long long write_full(int fd, const char *p, size_t n, long long off) {
    while (n) {
        ssize_t w = pwrite(fd, p, n, (off_t)off);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -(long long)errno;
        }
        if (w == 0) return -(long long)ENOSPC;
        p += w;
        n -= (size_t)w;
        off += w;
    }
    return 0;
}

/* Up to `n` bytes at `off`: how many were read (fewer at the file's end), or -errno. */
static long long read_full(int fd, char *p, size_t n, long long off) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, p + got, n - got, (off_t)(off + (long long)got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(long long)errno;
        }
        if (r == 0) break;
        got += (size_t)r;
    }
    return (long long)got;
}

typedef struct {
    Py_buffer buf;      /* what is written, or read into */
    Py_buffer dest;     /* reads: where a good block is copied (dest.obj NULL: nowhere) */
    long long offset;   /* in the file */
    Py_ssize_t length;  /* the block's bytes (the checksum covers these) */
    uint32_t crc;       /* reads: the checksum the block must have */
    long long result;
} Item;

static void release_items(Item *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i].buf.obj != NULL) PyBuffer_Release(&items[i].buf);
        if (items[i].dest.obj != NULL) PyBuffer_Release(&items[i].dest);
    }
    PyMem_Free(items);
}

/* Parse `seq` into items: (buffer, offset, length) for writes, (buffer, offset, length, crc,
 * dest or None) for reads. NULL with an exception set on bad input. */
static Item *parse_items(PyObject *seq, int reading, Py_ssize_t *count) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Item *items = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Item));
    if (items == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t want = reading ? 5 : 3;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != want) {
            PyErr_Format(PyExc_TypeError, "item %zd: a tuple of %zd expected", i, want);
            goto fail;
        }
        Item *it = &items[i];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 0), &it->buf,
                               reading ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
            goto fail;
        it->offset = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 1));
        it->length = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 2));
        if (PyErr_Occurred()) goto fail;
        if (it->offset < 0 || it->length < 0 || it->length > it->buf.len) {
            PyErr_Format(PyExc_ValueError, "item %zd: offset %lld, length %zd of a %zd-byte "
                         "buffer", i, it->offset, it->length, it->buf.len);
            goto fail;
        }
        if (reading) {
            unsigned long crc = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 3));
            if (PyErr_Occurred()) goto fail;
            if (crc > 0xFFFFFFFFul) {
                PyErr_Format(PyExc_ValueError, "item %zd: a CRC-32 above 32 bits", i);
                goto fail;
            }
            it->crc = (uint32_t)crc;
            PyObject *dest = PyTuple_GET_ITEM(t, 4);
            if (dest != Py_None) {
                if (PyObject_GetBuffer(dest, &it->dest, PyBUF_WRITABLE) < 0) goto fail;
                if (it->dest.len < it->length) {
                    PyErr_Format(PyExc_ValueError, "item %zd: a %zd-byte destination for a "
                                 "%zd-byte block", i, it->dest.len, it->length);
                    goto fail;
                }
            }
        }
    }
    *count = n;
    return items;
fail:
    release_items(items, n);
    return NULL;
}

/* A block that moved whole (`moved` bytes of its buffer): a write's result is its CRC; a
 * read's is 1 when its first `length` bytes came with the CRC it must have (then copied to
 * its destination, if any), 0 when short (torn) or corrupt. */
static void settle(Item *it, int reading, long long moved) {
    unsigned char *p = it->buf.buf;
    if (!reading) {
        it->result = (long long)crc32_of(0, p, (size_t)it->length);
        return;
    }
    if (moved < it->length || crc32_of(0, p, (size_t)it->length) != it->crc) {
        it->result = 0;
        return;
    }
    if (it->dest.obj != NULL) memcpy(it->dest.buf, p, (size_t)it->length);
    it->result = 1;
}

/* How many items from `i` lie back to back in the file (at most MAX_VECTOR, up to
 * MAX_VECTOR_BYTES): blocks demoted together sit in consecutive slots, and one read of all of
 * them costs one system call and lets the drive take a larger transfer (bench/tiers.py:
 * promotions of 64 KiB blocks from ~0.8 to ~1.05 GB/s, the raw drive's one-block reads).
 * Writes stay one per block: a run of them in one pwritev measured slower (0.6-0.8 against
 * 0.9-1.0 GB/s at 64 KiB on ext4 over virtio), so `run_batch` only reads runs this way. */
static Py_ssize_t contiguous_run(const Item *items, Py_ssize_t i, Py_ssize_t n) {
    Py_ssize_t k = i + 1;
    long long bytes = items[i].buf.len;
    while (k < n && k - i < MAX_VECTOR &&
           items[k].offset == items[k - 1].offset + (long long)items[k - 1].buf.len &&
           bytes + items[k].buf.len <= MAX_VECTOR_BYTES) {
        bytes += items[k].buf.len;
        k++;
    }
    return k - i;
}

/* The whole run in one pwritev / preadv: 0 when every byte moved, -1 otherwise (the caller
 * then moves the run block by block, so each block gets its own result; rewriting or
 * rereading what did move is harmless). */
static int vector_io(int fd, Item *run, Py_ssize_t count, int reading) {
    struct iovec iov[MAX_VECTOR];
    long long total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        iov[k].iov_base = run[k].buf.buf;
        iov[k].iov_len = (size_t)run[k].buf.len;
        total += run[k].buf.len;
    }
    for (;;) {
        ssize_t r = reading ? preadv(fd, iov, (int)count, (off_t)run[0].offset)
                            : pwritev(fd, iov, (int)count, (off_t)run[0].offset);
        if (r < 0 && errno == EINTR) continue;
        return r == total ? 0 : -1;
    }
}

static PyObject *run_batch(PyObject *args, int reading) {
    int fd;
    PyObject *arg;
    if (!PyArg_ParseTuple(args, reading ? "iO:read_blocks" : "iO:write_blocks", &fd, &arg))
        return NULL;
    PyObject *seq = PySequence_Fast(arg, "items must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = 0;
    Item *items = parse_items(seq, reading, &n);
    Py_DECREF(seq);
    if (items == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t run = reading ? contiguous_run(items, i, n) : 1;
        if (run > 1 && vector_io(fd, items + i, run, reading) == 0) {
            for (Py_ssize_t k = i; k < i + run; k++) settle(&items[k], reading,
                                                            items[k].buf.len);
            i += run;
            continue;
        }
        for (Py_ssize_t k = i; k < i + run; k++) {     /* one by one: each its own result */
            Item *it = &items[k];
            long long r = reading
                ? read_full(fd, (char *)it->buf.buf, (size_t)it->buf.len, it->offset)
                : write_full(fd, (const char *)it->buf.buf, (size_t)it->buf.len, it->offset);
            if (r < 0) it->result = r;
            else settle(it, reading, reading ? r : it->buf.len);
        }
        i += run;
    }
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(items[i].result);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    release_items(items, n);
    return out;
}

PyDoc_STRVAR(write_blocks_doc,
"write_blocks(fd, items) -> list[int]\n\n"
"Write each item (buffer, offset, length): the whole buffer at `offset`; per item the CRC-32\n"
"of its first `length` bytes, or -errno. The GIL is released for the whole batch.");

static PyObject *write_blocks(PyObject *self, PyObject *args) { return run_batch(args, 0); }

PyDoc_STRVAR(read_blocks_doc,
"read_blocks(fd, items) -> list[int]\n\n"
"Read each item (buffer, offset, length, crc, dest): len(buffer) bytes at `offset`; 1 when\n"
"its first `length` bytes came whole with checksum `crc` (then copied into `dest` unless it\n"
"is None), 0 when short or corrupt, -errno on an error. The GIL is released for the batch.");

static PyObject *read_blocks(PyObject *self, PyObject *args) { return run_batch(args, 1); }

PyDoc_STRVAR(copy_into_doc,
"copy_into(dest, data) -> None\n\n"
"Copy `data` into the start of the writable buffer `dest` (at least as long), the GIL\n"
"released while a large copy runs (the event loop copies each demoted block out of its pool\n"
"slot; meanwhile the tier's I/O threads may run).");

static PyObject *copy_into(PyObject *self, PyObject *args) {
    Py_buffer dest, data;
    if (!PyArg_ParseTuple(args, "w*y*:copy_into", &dest, &data)) return NULL;
    if (data.len > dest.len) {
        PyBuffer_Release(&dest);
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "copy_into: the data is longer than the destination");
        return NULL;
    }
    if (data.len >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dest.buf, data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dest.buf, data.buf, (size_t)data.len);
    }
    PyBuffer_Release(&dest);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(crc32_doc,
"crc32(data, value=0) -> int\n\n"
"zlib's CRC-32, as the batches compute it (for tests).");

static PyObject *crc32_py(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "y*|k:crc32", &data, &value)) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32_of((uint32_t)value, data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

static PyMethodDef methods[] = {
    {"write_blocks", write_blocks, METH_VARARGS, write_blocks_doc},
    {"read_blocks", read_blocks, METH_VARARGS, read_blocks_doc},
    {"crc32", crc32_py, METH_VARARGS, crc32_doc},
    {"copy_into", copy_into, METH_VARARGS, copy_into_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockio",
    "The disk tier's batched block I/O (see kvd_server/tiers/disk/block_io.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__blockio(void) {
    void *lib = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib != NULL) zlib_crc32 = (zlib_crc32_fn)dlsym(lib, "crc32");
    if (zlib_crc32 == NULL) {
        PyErr_SetString(PyExc_ImportError, "kvd_server.tiers.disk._blockio needs libz.so.1 (zlib's crc32)");
        return NULL;
    }
#ifdef HAVE_CLMUL_CODE
    __builtin_cpu_init();
    use_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1") &&
                getenv("KVD_NO_CLMUL") == NULL;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#ifdef HAVE_CLMUL_CODE
    if (PyModule_AddIntConstant(m, "CLMUL", use_clmul) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#else
    if (PyModule_AddIntConstant(m, "CLMUL", 0) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
