/* kvd_proto._native: the per-key loops of the shared index, compiled.
 *
 * The shared index (kvd_proto/index_layout.py) is read on the engine's scheduler thread once
 * per looked-up chunk and written by the daemon once per stored or freed block. In Python
 * each probe costs 1-2 us; here ~0.1 us. Everything in this file has a pure-Python twin
 * (kvd_proto/native.py picks one; KVD_NATIVE=0 forces Python), and the tests run both.
 *
 * Types:
 *   Lookups   the engine side: probes a read-only mapping of an index and answers the
 *             scheduler's lookups (HIT / MISS here, anything else through a Python fallback:
 *             a store in flight, the engine's own store, a key the namespace's "held below"
 *             table names, kvd_proto/below_layout.py).
 *   IndexTable the daemon side: find / insert / remove (backward-shift deletion) / key_of on
 *             its writable mapping, with the index's write order (key, meta, bucket).
 *
 * Memory order: the daemon publishes a slot's key before its meta word and its meta word
 * before its bucket (release stores); a reader loads the bucket, the meta word, the key and
 * the meta word again (acquire loads) and trusts the answer only if both words agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

#include "_records.h"
#include "_lookups.h"
#include "_rings.h"
#include "_kept.h"


/* ---------------------------------------------------------------- CRC-32 (zlib's) */

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xFF] ^ (c >> 8);
            crc_table[t][i] = c;
        }
    }
}

/* Eight bytes into the CRC register at once (slice-by-8): `lo` and `hi` are the next eight
 * bytes in the order they are taken, as two little-endian words. */
static inline uint32_t crc_step8(uint32_t c, uint32_t lo, uint32_t hi) {
    lo ^= c;
    return crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
           crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^
           crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
           crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
}

/* Four bytes from p[0] up (forward) or from p[0] down (backward), as a little-endian word
 * whatever the machine's byte order (compilers make one load, or a load and a swap). */
static inline uint32_t word_up(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint32_t word_down(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[-1] << 8 | (uint32_t)p[-2] << 16 | (uint32_t)p[-3] << 24;
}

/* zlib.crc32(data) with its initial value 0 (slice-by-8). */
static uint32_t crc32_of(const unsigned char *p, Py_ssize_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (; n >= 8; p += 8, n -= 8) c = crc_step8(c, word_up(p), word_up(p + 4));
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* zlib.crc32 of the bytes in reverse order (the fingerprint's upper half), without reversing
 * them: slice-by-8 from the end (a byte at a time cost ~40 ns of a 36-byte key's miss). */
static uint32_t crc32_reversed(const unsigned char *p, Py_ssize_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (; n >= 8; n -= 8) c = crc_step8(c, word_down(p + n - 1), word_down(p + n - 5));
    while (n--) c = crc_table[0][(c ^ p[n]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static PyObject *native_crc32(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t c = crc32_of(b.buf, b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* The "held below" fingerprint (kvd_proto/below_layout.py): crc32(key) | crc32(reversed) << 32,
 * never 0. */
static uint64_t fingerprint_of(const unsigned char *p, Py_ssize_t n) {
    uint64_t fp = (uint64_t)crc32_of(p, n) | (uint64_t)crc32_reversed(p, n) << 32;
    return fp ? fp : 1;
}

static PyObject *native_fingerprint(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t fp = fingerprint_of(b.buf, b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(fp);
}

#define BELOW_HEADER_BYTES 4096
#define BELOW_FLAGS_OFFSET 24
#define BELOW_FLAG_ASK 1
#define BELOW_MAX_BUCKETS (1ull << 24)


static int below_bind(Below *t, PyObject *obj) {
    if (PyObject_GetBuffer(obj, &t->buf, PyBUF_SIMPLE) < 0) return -1;
    const unsigned char *base = t->buf.buf;
    uint32_t version = 0, header = 0;
    uint64_t buckets = 0;
    if (t->buf.len >= 24) {
        memcpy(&version, base + 8, 4);
        memcpy(&header, base + 12, 4);
        memcpy(&buckets, base + 16, 8);
    }
    if (t->buf.len < 24 || memcmp(base, "KVDBLW01", 8) || version != 1 ||
        header != BELOW_HEADER_BYTES || buckets == 0 || (buckets & (buckets - 1)) ||
        buckets > BELOW_MAX_BUCKETS ||
        (unsigned long long)t->buf.len < BELOW_HEADER_BYTES + 8 * buckets) {
        PyBuffer_Release(&t->buf);
        PyErr_SetString(PyExc_ValueError, "not a kvd below table of version 1 (or shorter "
                                          "than its header says)");
        return -1;
    }
    t->buckets = (uint64_t *)(base + BELOW_HEADER_BYTES);
    t->flags = (uint32_t *)(base + BELOW_FLAGS_OFFSET);
    t->mask = buckets - 1;
    t->bound = 1;
    return 0;
}

static void below_release(Below *t) {
    if (t->bound) {
        PyBuffer_Release(&t->buf);
        t->bound = 0;
    }
}

static int below_has(const Below *t, const unsigned char *key, Py_ssize_t n) {
    uint64_t fp = fingerprint_of(key, n);
    uint64_t b = fp & t->mask;
    for (int i = 0; i < MAX_PROBE; i++) {
        uint64_t v = __atomic_load_n(&t->buckets[b], __ATOMIC_ACQUIRE);
        if (v == fp) return 1;
        if (!v) return 0;
        b = (b + 1) & t->mask;
    }
    return 0;
}

/* ---------------------------------------------------------------- index geometry */


/* Map the regions of an index inside `obj` (a buffer: the mmap). */
static int geometry_bind(Geometry *g, PyObject *obj, int writable, unsigned long long buckets_off,
                         unsigned long long buckets, unsigned long long meta_off,
                         unsigned long long capacity, unsigned long long keys_off,
                         unsigned long long width, unsigned long long per_extent,
                         unsigned long long extent_bytes, unsigned long long stride) {
    if (buckets == 0 || (buckets & (buckets - 1)) || width == 0 || width > 255 ||
        per_extent == 0 || capacity == 0 || (buckets_off % 4) || (meta_off % 8)) {
        PyErr_SetString(PyExc_ValueError, "index geometry is not a valid layout");
        return -1;
    }
    if (PyObject_GetBuffer(obj, &g->buf, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    unsigned long long len = (unsigned long long)g->buf.len;
    if (buckets_off + 4 * buckets > len || meta_off + 8 * capacity > len ||
        keys_off + width * capacity > len || capacity > 0xFFFFFFFEull) {
        PyBuffer_Release(&g->buf);
        PyErr_SetString(PyExc_ValueError, "index regions run past the end of the mapping");
        return -1;
    }
    char *base = g->buf.buf;
    g->buckets = (uint32_t *)(base + buckets_off);
    g->mask = buckets - 1;
    g->meta = (uint64_t *)(base + meta_off);
    g->capacity = capacity;
    g->keys = (unsigned char *)(base + keys_off);
    g->width = (Py_ssize_t)width;
    g->per_extent = per_extent;
    g->extent_bytes = extent_bytes;
    g->stride = stride;
    g->bound = 1;
    return 0;
}

static void geometry_release(Geometry *g) {
    if (g->bound) {
        PyBuffer_Release(&g->buf);
        g->bound = 0;
    }
}

static inline uint64_t load_acquire64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint32_t load_acquire32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* probe() from the key's bucket `b` (its hash & mask). */
static int64_t probe_at(const Geometry *g, uint64_t b, const unsigned char *key, Py_ssize_t n,
                        uint64_t *word) {
    if (n <= 0 || n > g->width) return -1;
    for (int i = 0; i < MAX_PROBE; i++) {
        uint32_t v = load_acquire32(&g->buckets[b]);
        if (v == 0) return -1;
        uint64_t slot = (uint64_t)v - 1;
        if (slot < g->capacity) {
            /* The key's line is asked for before the meta word is read: two misses at once,
             * not one after the other (the meta word does not tell where the key is). */
            __builtin_prefetch(g->keys + slot * g->width);
            uint64_t w = load_acquire64(&g->meta[slot]);
            if ((w & 3) && (Py_ssize_t)((w >> 2) & 0xFF) == n &&
                memcmp(g->keys + slot * g->width, key, (size_t)n) == 0) {
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (load_acquire64(&g->meta[slot]) == w) {
                    *word = w;
                    return (int64_t)slot;
                }
            }
        }
        b = (b + 1) & g->mask;
    }
    return -1;
}

/* The slot holding `key` (storing or ready), its meta word in *word; -1 if none. */
static int64_t probe(const Geometry *g, const unsigned char *key, Py_ssize_t n, uint64_t *word) {
    if (n <= 0 || n > g->width) return -1;
    return probe_at(g, crc32_of(key, n) & g->mask, key, n, word);
}

static inline uint64_t offset_of(const Geometry *g, uint64_t slot) {
    return slot / g->per_extent * g->extent_bytes + slot % g->per_extent * g->stride;
}

int64_t lookups_probe(const Lookups *self, PyObject *key, uint64_t *word) {
    return probe(&self->g, (unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), word);
}

uint64_t lookups_offset(const Lookups *self, uint64_t slot) { return offset_of(&self->g, slot); }

uint64_t lookups_prefetch(const Lookups *self, PyObject *key) {
    const Geometry *g = &self->g;
    uint64_t b = crc32_of((unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) & g->mask;
    __builtin_prefetch(&g->buckets[b]);
    return b;
}

void lookups_prefetch_slots(const Lookups *self, uint64_t bucket) {
    const Geometry *g = &self->g;
    for (int i = 0; i < 2; i++) {          /* a miss reads ~1.5 occupied buckets at half load */
        uint32_t v = load_acquire32(&g->buckets[bucket]);
        if (v == 0 || (uint64_t)v - 1 >= g->capacity) return;
        __builtin_prefetch(&g->meta[v - 1]);
        __builtin_prefetch(g->keys + (uint64_t)(v - 1) * g->width);
        bucket = (bucket + 1) & g->mask;
    }
}

int64_t lookups_probe_at(const Lookups *self, uint64_t bucket, PyObject *key, uint64_t *word) {
    return probe_at(&self->g, bucket, (unsigned char *)PyBytes_AS_STRING(key),
                    PyBytes_GET_SIZE(key), word);
}

static int parse_geometry(PyObject *args, PyObject **obj, unsigned long long v[9]) {
    return PyArg_ParseTuple(args, "OKKKKKKKKK", obj, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                            &v[6], &v[7], &v[8]);
}

/* ---------------------------------------------------------------- this step's HITs */

/* What the lookups answered HIT this step, for the step's loads (pin, hit_offset). A dict of
 * key -> offset cost the hottest call ~70 ns a HIT in the scheduler's loop (an int object and
 * an insertion into a table gone cold since the last lookup); a HIT is appended to a log
 * instead (the key held, its offset), and a load finds its keys there by identity: vLLM loads
 * the very key objects it looked up, a request's keys one after another, and its requests'
 * loads in the order it looked them up, so a load's first key is found where the last load's
 * keys ended (`pin_cursor`) and each next one a single compare further (a step that admits
 * 128 requests logs ~13,000 HITs: a scan back from the end for each load's first key would
 * read most of them). A key the scan does not find
 * (another object of equal value, a log past HITS_SCAN) moves the log into the dict and is
 * looked up there by value. */
#define HITS_LOG_MAX 65536       /* entries the log holds before it moves into the dict */
#define HITS_SCAN 4096           /* entries scanned back for a key before the dict decides */
#define HITS_NEAR 16             /* entries looked at from the hint on */

static void hits_release(Lookups *self) {
    for (Py_ssize_t i = 0; i < self->hit_n; i++) Py_DECREF(self->hit_log[i].key);
    self->hit_n = 0;
    self->pin_cursor = 0;
}

static void hits_clear(Lookups *self) {
    hits_release(self);
    if (self->hits != NULL) PyDict_Clear(self->hits);
}

/* The log into the dict, in order (a later HIT of a key replaces an earlier one). */
static int hits_spill(Lookups *self) {
    HitEntry *log = self->hit_log;
    Py_ssize_t n = self->hit_n, done = 0;
    int rc = 0;
    for (; done < n; done++) {
        PyObject *off = PyLong_FromUnsignedLongLong(log[done].offset);
        if (off == NULL || PyDict_SetItem(self->hits, log[done].key, off) < 0) {
            Py_XDECREF(off);
            rc = -1;
            break;
        }
        Py_DECREF(off);
        Py_DECREF(log[done].key);
    }
    memmove(log, log + done, (size_t)(n - done) * sizeof *log);
    self->hit_n = n - done;
    self->pin_cursor = 0;
    return rc;
}

static int hits_add(Lookups *self, PyObject *key, uint64_t offset) {
    if (self->hit_n == self->hit_cap) {
        if (self->hit_cap >= HITS_LOG_MAX) {
            if (hits_spill(self) < 0) return -1;
        } else {
            Py_ssize_t cap = self->hit_cap ? self->hit_cap * 2 : 256;
            HitEntry *log = PyMem_Realloc(self->hit_log, (size_t)cap * sizeof *log);
            if (log == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            self->hit_log = log;
            self->hit_cap = cap;
        }
    }
    self->hit_log[self->hit_n].key = Py_NewRef(key);
    self->hit_log[self->hit_n].offset = offset;
    self->hit_n++;
    return 0;
}

int lookups_hit_find(Lookups *self, PyObject *key, Py_ssize_t *hint, uint64_t *offset) {
    HitEntry *log = self->hit_log;
    Py_ssize_t n = self->hit_n, h = *hint;
    if (h >= 0) {                   /* at the hint, or a little past it (a lookup in between) */
        for (Py_ssize_t i = h; i < n && i < h + HITS_NEAR; i++) {
            if (log[i].key == key) {
                *offset = log[i].offset;
                *hint = i + 1;
                return 1;
            }
        }
    }
    for (Py_ssize_t i = n - 1; i >= 0 && i >= n - HITS_SCAN; i--) {
        if (log[i].key == key) {
            *offset = log[i].offset;
            *hint = i + 1;
            return 1;
        }
    }
    *hint = -1;
    if (n && hits_spill(self) < 0) return -1;
    PyObject *off = PyDict_GetItemWithError(self->hits, key);
    if (off == NULL) return PyErr_Occurred() ? -1 : 0;
    *offset = PyLong_AsUnsignedLongLong(off);
    return *offset == (uint64_t)-1 && PyErr_Occurred() ? -1 : 1;
}

static PyObject *Lookups_hit(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "hit(key: bytes, offset: int)");
        return NULL;
    }
    unsigned long long offset = PyLong_AsUnsignedLongLong(args[1]);
    if (offset == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    /* The log and its dict hold plain bytes only: a subclass's __eq__ or __hash__ (Python
     * code) never runs while the log moves into the dict. */
    PyObject *key = PyBytes_CheckExact(args[0]) ? Py_NewRef(args[0]) :
        PyBytes_FromStringAndSize(PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]));
    if (key == NULL) return NULL;
    int rc = hits_add(self, key, offset);
    Py_DECREF(key);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Lookups_hit_offset(Lookups *self, PyObject *key) {
    Py_ssize_t hint = -1;
    uint64_t offset;
    int found = lookups_hit_find(self, key, &hint, &offset);
    if (found < 0) return NULL;
    if (!found) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(offset);
}

static PyObject *Lookups_clear_hits(Lookups *self, PyObject *unused) {
    hits_clear(self);
    Py_RETURN_NONE;
}

static PyObject *Lookups_recorded(Lookups *self, PyObject *unused) {
    if (hits_spill(self) < 0) return NULL;
    return PyDict_Copy(self->hits);
}

/* ---------------------------------------------------------------- Lookups (engine) */

static void ahead_forget(Lookups *self);


static int Lookups_init(Lookups *self, PyObject *args, PyObject *kw) {
    PyObject *stores, *miss, *hit, *fallback, *kept = NULL;
    static char *names[] = {"stores", "miss", "hit", "fallback", "kept", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!OOO|O", names, &PyDict_Type, &stores, &miss,
                                     &hit, &fallback, &kept))
        return -1;
    if (kept == Py_None) kept = NULL;     /* else a KeptTable, or any sized container */
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return -1;
    }
    PyObject *hits = PyDict_New();
    if (hits == NULL) return -1;
    hits_clear(self);
    Py_XSETREF(self->hits, hits);
    Py_XSETREF(self->stores, Py_NewRef(stores));
    Py_XSETREF(self->miss, Py_NewRef(miss));
    Py_XSETREF(self->hit, Py_NewRef(hit));
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    Py_XSETREF(self->kept, Py_XNewRef(kept));
    return 0;
}

static void Lookups_dealloc(Lookups *self) {
    hits_clear(self);
    PyMem_Free(self->hit_log);
    geometry_release(&self->g);
    below_release(&self->below);
    Py_XDECREF(self->hits);
    Py_XDECREF(self->stores);
    Py_XDECREF(self->miss);
    Py_XDECREF(self->hit);
    Py_XDECREF(self->fallback);
    Py_XDECREF(self->kept);
    ahead_forget(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Lookups_bind(Lookups *self, PyObject *args) {
    PyObject *obj;
    unsigned long long v[9];
    if (!parse_geometry(args, &obj, v)) return NULL;
    geometry_release(&self->g);
    ahead_forget(self);
    self->enabled = 0;
    if (geometry_bind(&self->g, obj, 0, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Lookups_unbind(Lookups *self, PyObject *unused) {
    ahead_forget(self);
    self->enabled = 0;
    geometry_release(&self->g);
    below_release(&self->below);
    Py_RETURN_NONE;
}

static PyObject *Lookups_bind_below(Lookups *self, PyObject *obj) {
    below_release(&self->below);
    if (below_bind(&self->below, obj) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Lookups_unbind_below(Lookups *self, PyObject *unused) {
    below_release(&self->below);
    Py_RETURN_NONE;
}

static PyObject *Lookups_below_flags(Lookups *self, PyObject *unused) {
    return PyLong_FromUnsignedLong(
        self->below.bound ? __atomic_load_n(self->below.flags, __ATOMIC_ACQUIRE) : 0);
}

static PyObject *Lookups_below(Lookups *self, PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "key must be bytes");
        return NULL;
    }
    return PyBool_FromLong(self->below.bound &&
                           below_has(&self->below, (unsigned char *)PyBytes_AS_STRING(key),
                                     PyBytes_GET_SIZE(key)));
}

static PyObject *Lookups_find(Lookups *self, PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "key must be bytes");
        return NULL;
    }
    if (!self->g.bound) Py_RETURN_NONE;
    uint64_t word;
    int64_t slot = probe(&self->g, (unsigned char *)PyBytes_AS_STRING(key),
                         PyBytes_GET_SIZE(key), &word);
    if (slot < 0) Py_RETURN_NONE;
    return Py_BuildValue("(iK)", (int)(word & 3),
                         (unsigned long long)offset_of(&self->g, (uint64_t)slot));
}

/* Lookahead. vLLM's scheduler looks up a waiting request's keys one call at a time, in the
 * request's key order, each call a cold probe of the index (its bucket, then its meta word and
 * key: two memory latencies one after the other, most of a lookup's cost). The request context
 * it passes keeps that order (ReqContext._offload_key_positions, a dict filled in key order
 * before the lookups). So a context's first lookup, and each lookup past what was read ahead,
 * reads the next keys of the context in one batch (8 at the first, then AHEAD_MAX): every
 * line asked for at once, so that their misses overlap, then each key probed. The following
 * lookups answer from the batch while they name its keys in order (identity; the batch holds
 * them); anything else (another key, a context without that dict) probes at its own call.
 *
 * Why a HIT read ahead may be answered later in the step: a slot the daemon frees during the
 * step is not reused before this engine publishes a newer epoch (at its next step's start),
 * the same rule that keeps a HIT loadable until its load. Only READY answers are kept (a
 * miss or a store in flight is probed again at its call), and the batch is dropped whenever
 * `enabled` is set (each step's start and end, a reset). */
#define AHEAD_FIRST 8
#define AHEAD_SCAN 1024     /* entries searched for a context's first key */
#define AHEAD_PROBE (-2)    /* lookahead(): no answer read ahead, probe now */

static PyObject *ahead_attr;    /* "_offload_key_positions" */

static void ahead_drop(Lookups *self) {
    for (int i = 0; i < self->ahead_n; i++) Py_DECREF(self->ahead_keys[i]);
    self->ahead_n = self->ahead_i = 0;
}

static void ahead_forget(Lookups *self) {
    ahead_drop(self);
    Py_CLEAR(self->ahead_ctx);
}

/* Read keys[0..n) of the index: their lines asked for pass by pass, then probed. */
static void ahead_read(Lookups *self, int n) {
    const Geometry *g = &self->g;
    PyObject **keys = self->ahead_keys;
    uint64_t bucket[AHEAD_MAX + 1];
    for (int i = 0; i < n; i++) {
        const char *p = PyBytes_AS_STRING(keys[i]);
        __builtin_prefetch(p);
        __builtin_prefetch(p + PyBytes_GET_SIZE(keys[i]) - 1);
    }
    for (int i = 0; i < n; i++) {
        Py_ssize_t len = PyBytes_GET_SIZE(keys[i]);
        bucket[i] = len > 0 && len <= g->width ?
            crc32_of((unsigned char *)PyBytes_AS_STRING(keys[i]), len) & g->mask : UINT64_MAX;
        if (bucket[i] != UINT64_MAX) __builtin_prefetch(&g->buckets[bucket[i]]);
    }
    for (int i = 0; i < n; i++)
        if (bucket[i] != UINT64_MAX) lookups_prefetch_slots(self, bucket[i]);
    for (int i = 0; i < n; i++) {
        uint64_t word = 0;
        int64_t slot = bucket[i] == UINT64_MAX ? -1 :
            probe_at(g, bucket[i], (unsigned char *)PyBytes_AS_STRING(keys[i]),
                     PyBytes_GET_SIZE(keys[i]), &word);
        self->ahead_slot[i] = slot >= 0 && (word & 3) == STATE_READY ? slot : -1;
        self->ahead_word[i] = word;
    }
    self->ahead_read += (unsigned long long)n;
}

/* The slot of `key` read ahead (READY, its word in *word), -1 if it was read ahead and was no
 * READY key, or AHEAD_PROBE: not read ahead, probe now. */
static int64_t lookahead(Lookups *self, PyObject *key, PyObject *ctx, uint64_t *word) {
    if (ctx == self->ahead_ctx) {
        if (self->ahead_off) return AHEAD_PROBE;
        if (self->ahead_i < self->ahead_n) {
            int i = self->ahead_i;
            if (self->ahead_keys[i] != key) {     /* another order: probe at each call */
                self->ahead_off = 1;
                ahead_drop(self);
                return AHEAD_PROBE;
            }
            self->ahead_i++;
            if (self->ahead_slot[i] < 0) return AHEAD_PROBE;
            *word = self->ahead_word[i];
            return self->ahead_slot[i];
        }
    } else {
        Py_XSETREF(self->ahead_ctx, Py_NewRef(ctx));
        self->ahead_pos = 0;
        self->ahead_batch = AHEAD_FIRST;
    }
    ahead_drop(self);
    self->ahead_off = 1;                          /* unless the key is found below */
    PyObject *order = PyObject_GetAttr(ctx, ahead_attr);
    if (order == NULL) {
        PyErr_Clear();
        return AHEAD_PROBE;
    }
    if (ctx != self->ahead_ctx || self->ahead_n) {  /* the attribute's code looked up too */
        Py_DECREF(order);
        ahead_drop(self);
        self->ahead_off = 1;
        return AHEAD_PROBE;
    }
    if (PyDict_CheckExact(order)) {
        Py_ssize_t pos = self->ahead_pos;
        PyObject *k, *v;
        int found = 0;
        for (int i = 0; i < AHEAD_SCAN && PyDict_Next(order, &pos, &k, &v); i++) {
            if (k == key) {
                found = 1;
                break;
            }
            if (self->ahead_pos) break;           /* a continuation: only the next key */
        }
        if (found) {
            int n = 0;
            self->ahead_keys[n++] = Py_NewRef(key);
            while (n <= self->ahead_batch && PyDict_Next(order, &pos, &k, &v))
                if (PyBytes_CheckExact(k)) self->ahead_keys[n++] = Py_NewRef(k);
            ahead_read(self, n);
            self->ahead_n = n;
            self->ahead_i = 1;
            self->ahead_pos = pos;
            self->ahead_off = 0;
            self->ahead_batch = AHEAD_MAX;
        }
    }
    Py_DECREF(order);
    if (self->ahead_n == 0 || self->ahead_slot[0] < 0) return AHEAD_PROBE;
    *word = self->ahead_word[0];
    return self->ahead_slot[0];
}

/* lookup(key, context=None): HIT or MISS at once where the index alone decides; the
 * fallback otherwise (not enabled, a store in flight, the engine's own store). */
static PyObject *Lookups_lookup(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "lookup(key, context=None)");
        return NULL;
    }
    PyObject *key = args[0];
    if (!self->enabled || !self->g.bound || !PyBytes_CheckExact(key))
        return PyObject_CallOneArg(self->fallback, key);
    uint64_t word = 0;
    int64_t slot = nargs == 2 && args[1] != Py_None ? lookahead(self, key, args[1], &word)
                                                    : AHEAD_PROBE;
    if (slot == AHEAD_PROBE)
        slot = probe(&self->g, (unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                     &word);
    if (slot >= 0) {
        if ((word & 3) != STATE_READY) return PyObject_CallOneArg(self->fallback, key);
        if (hits_add(self, key, offset_of(&self->g, (uint64_t)slot)) < 0) return NULL;
        self->lookups++;
        self->hit_count++;
        return Py_NewRef(self->hit);
    }
    int own = PyDict_Contains(self->stores, key);
    if (own == 0 && self->kept != NULL) {
        if (Py_IS_TYPE(self->kept, &KeptTableType))
            own = kept_table_contains(self->kept, key);
        else {
            Py_ssize_t size = PyObject_Length(self->kept);
            own = size < 0 ? -1 : size > 0 ? PySequence_Contains(self->kept, key) : 0;
        }
    }
    if (own < 0) return NULL;
    if (own || (self->below.bound &&
                ((__atomic_load_n(self->below.flags, __ATOMIC_ACQUIRE) & BELOW_FLAG_ASK) ||
                 below_has(&self->below, (unsigned char *)PyBytes_AS_STRING(key),
                           PyBytes_GET_SIZE(key)))))
        return PyObject_CallOneArg(self->fallback, key);
    self->lookups++;
    self->miss_count++;
    return Py_NewRef(self->miss);
}

/* find_new(keys, use_index): the keys that are neither the engine's own stores nor (with
 * use_index) in the index, in order. */
static PyObject *Lookups_find_new(Lookups *self, PyObject *args) {
    PyObject *keys;
    int use_index;
    if (!PyArg_ParseTuple(args, "Op", &keys, &use_index)) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        int own = PyDict_Contains(self->stores, key);
        if (own < 0) goto fail;
        if (own) continue;
        if (use_index && self->g.bound) {
            if (!PyBytes_Check(key)) {
                PyErr_SetString(PyExc_TypeError, "keys must be bytes");
                goto fail;
            }
            uint64_t word;
            if (probe(&self->g, (unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                      &word) >= 0)
                continue;
        }
        if (PyList_Append(out, key) < 0) goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

static PyMethodDef Lookups_methods[] = {
    {"bind", (PyCFunction)Lookups_bind, METH_VARARGS,
     "bind(mapping, buckets_offset, buckets, meta_offset, capacity, keys_offset, key_width, "
     "per_extent, extent_bytes, stride): read this index from now on (disables lookups)"},
    {"unbind", (PyCFunction)Lookups_unbind, METH_NOARGS, "forget the index (its mapping may close)"},
    {"find", (PyCFunction)Lookups_find, METH_O, "find(key) -> (state, offset) or None"},
    {"bind_below", (PyCFunction)Lookups_bind_below, METH_O,
     "bind_below(mapping): read the namespace's held-below table from now on"},
    {"unbind_below", (PyCFunction)Lookups_unbind_below, METH_NOARGS,
     "forget the held-below table (its mapping may close)"},
    {"below_flags", (PyCFunction)Lookups_below_flags, METH_NOARGS,
     "below_flags() -> the held-below table's flags word (0 when none is bound)"},
    {"below", (PyCFunction)Lookups_below, METH_O,
     "below(key) -> whether the held-below table names the key"},
    {"lookup", (PyCFunction)(void (*)(void))Lookups_lookup, METH_FASTCALL,
     "lookup(key, context=None) -> the hit or miss answer, or the fallback's"},
    {"hit", (PyCFunction)(void (*)(void))Lookups_hit, METH_FASTCALL,
     "hit(key, offset): record a HIT of this step answered elsewhere (the Python path)"},
    {"hit_offset", (PyCFunction)Lookups_hit_offset, METH_O,
     "hit_offset(key) -> the offset of a HIT of this step for key, or None"},
    {"clear_hits", (PyCFunction)Lookups_clear_hits, METH_NOARGS,
     "clear_hits(): this step's HITs lapse"},
    {"recorded", (PyCFunction)Lookups_recorded, METH_NOARGS,
     "recorded() -> {key: offset} of this step's HITs (a copy)"},
    {"find_new", (PyCFunction)Lookups_find_new, METH_VARARGS,
     "find_new(keys, use_index) -> keys neither stored here nor (use_index) in the index"},
    {"store", (PyCFunction)(void (*)(void))Lookups_store, METH_FASTCALL, LOOKUPS_STORE_DOC},
    {"pin", (PyCFunction)(void (*)(void))Lookups_pin, METH_FASTCALL, LOOKUPS_PIN_DOC},
    {"complete", (PyCFunction)(void (*)(void))Lookups_complete, METH_FASTCALL,
     LOOKUPS_COMPLETE_DOC},
    {"settle", (PyCFunction)(void (*)(void))Lookups_settle, METH_FASTCALL, LOOKUPS_SETTLE_DOC},
    {NULL}};

static PyMemberDef Lookups_members[] = {
    {"lookups", T_ULONGLONG, offsetof(Lookups, lookups), 0, "lookups answered"},
    {"hits", T_ULONGLONG, offsetof(Lookups, hit_count), 0, "HITs answered"},
    {"misses", T_ULONGLONG, offsetof(Lookups, miss_count), 0, "MISSes answered"},
    {"read_ahead", T_ULONGLONG, offsetof(Lookups, ahead_read), READONLY,
     "keys read ahead of their lookups (see lookahead() in kvd_proto/_native.c)"},
    {NULL}};

static PyObject *Lookups_bound(Lookups *self, void *closure) {
    return PyBool_FromLong(self->g.bound);
}

static PyObject *Lookups_get_enabled(Lookups *self, void *closure) {
    return PyLong_FromLong(self->enabled);
}

/* Set at each step's start and end and at a reset: what was read ahead is dropped. */
static int Lookups_set_enabled(Lookups *self, PyObject *value, void *closure) {
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "enabled cannot be deleted");
        return -1;
    }
    int on = PyObject_IsTrue(value);
    if (on < 0) return -1;
    ahead_forget(self);
    self->enabled = on;
    return 0;
}

static PyGetSetDef Lookups_getset[] = {
    {"bound", (getter)Lookups_bound, NULL, "whether an index is bound", NULL},
    {"enabled", (getter)Lookups_get_enabled, (setter)Lookups_set_enabled,
     "answer lookups here (else: the fallback); setting it drops what was read ahead", NULL},
    {NULL}};

static PyTypeObject LookupsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvd_proto._native.Lookups",
    .tp_basicsize = sizeof(Lookups),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An engine's lookups in a shared index (see kvd_proto/native.py)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lookups_init,
    .tp_dealloc = (destructor)Lookups_dealloc,
    .tp_methods = Lookups_methods,
    .tp_members = Lookups_members,
    .tp_getset = Lookups_getset,
};

/* ---------------------------------------------------------------- IndexTable (daemon) */

typedef struct {
    PyObject_HEAD
    Geometry g;
    unsigned long long overflows;
} IndexTable;

static int IndexTable_init(IndexTable *self, PyObject *args, PyObject *kw) {
    PyObject *obj;
    unsigned long long v[9];
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "IndexTable takes no keyword arguments");
        return -1;
    }
    if (!parse_geometry(args, &obj, v)) return -1;
    geometry_release(&self->g);
    return geometry_bind(&self->g, obj, 1, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]);
}

static void IndexTable_dealloc(IndexTable *self) {
    geometry_release(&self->g);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_bound(IndexTable *self) {
    if (!self->g.bound) {
        PyErr_SetString(PyExc_ValueError, "index released");
        return -1;
    }
    return 0;
}

static int check_slot(IndexTable *self, unsigned long long slot) {
    if (check_bound(self) < 0) return -1;
    if (slot >= self->g.capacity) {
        PyErr_Format(PyExc_IndexError, "slot %llu outside the index (%llu slots)", slot,
                     (unsigned long long)self->g.capacity);
        return -1;
    }
    return 0;
}

static PyObject *IndexTable_find(IndexTable *self, PyObject *key) {
    if (check_bound(self) < 0) return NULL;
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "key must be bytes");
        return NULL;
    }
    uint64_t word;
    int64_t slot = probe(&self->g, (unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                         &word);
    return PyLong_FromLongLong(slot);
}

static inline uint64_t meta_word(uint64_t state, uint64_t len, uint64_t gen) {
    return state | (len << 2) | (gen << 10);
}

/* insert(slot, key) -> bool: publish key as being stored in slot (key, meta, bucket). */
static PyObject *IndexTable_insert(IndexTable *self, PyObject *args) {
    unsigned long long slot;
    Py_buffer key;
    if (!PyArg_ParseTuple(args, "Ky*", &slot, &key)) return NULL;
    PyObject *result = NULL;
    if (check_slot(self, slot) < 0) goto done;
    Geometry *g = &self->g;
    if (key.len <= 0 || key.len > g->width) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    uint64_t home = crc32_of(key.buf, key.len) & g->mask;
    for (int i = 0; i < MAX_PROBE; i++) {
        uint64_t b = (home + i) & g->mask;
        if (g->buckets[b] == 0) {
            memcpy(g->keys + slot * g->width, key.buf, (size_t)key.len);
            uint64_t gen = (g->meta[slot] >> 10) + 1;
            __atomic_store_n(&g->meta[slot], meta_word(STATE_STORING, key.len, gen),
                             __ATOMIC_RELEASE);
            __atomic_store_n(&g->buckets[b], (uint32_t)(slot + 1), __ATOMIC_RELEASE);
            result = Py_NewRef(Py_True);
            goto done;
        }
    }
    self->overflows++;
    result = Py_NewRef(Py_False);
done:
    PyBuffer_Release(&key);
    return result;
}

static inline uint64_t home_of(Geometry *g, uint64_t slot, uint64_t len) {
    return crc32_of(g->keys + slot * g->width, (Py_ssize_t)len) & g->mask;
}

/* Backward-shift deletion of the bucket at `hole`: later entries of the run move up. */
static void delete_bucket(Geometry *g, uint64_t hole) {
    uint64_t j = hole;
    for (uint64_t n = 0; n <= g->mask; n++) {
        j = (j + 1) & g->mask;
        uint32_t v = g->buckets[j];
        if (v == 0) break;
        uint64_t s = (uint64_t)v - 1;
        uint64_t home = s < g->capacity ? home_of(g, s, (g->meta[s] >> 2) & 0xFF) : j;
        /* The entry at j may fill the hole unless its home lies cyclically in (hole, j]. */
        int stays = (hole < j) ? (hole < home && home <= j) : (home > hole || home <= j);
        if (stays) continue;
        __atomic_store_n(&g->buckets[hole], v, __ATOMIC_RELEASE);
        hole = j;
    }
    __atomic_store_n(&g->buckets[hole], 0, __ATOMIC_RELEASE);
}

/* remove(slot): unpublish it (meta first: FREE, generation + 1; then its bucket). */
static PyObject *IndexTable_remove(IndexTable *self, PyObject *arg) {
    unsigned long long slot = PyLong_AsUnsignedLongLong(arg);
    if (slot == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (check_slot(self, slot) < 0) return NULL;
    Geometry *g = &self->g;
    uint64_t w = g->meta[slot];
    if ((w & 3) == STATE_FREE) Py_RETURN_NONE;
    uint64_t len = (w >> 2) & 0xFF;
    uint64_t home = home_of(g, slot, len);
    __atomic_store_n(&g->meta[slot], meta_word(STATE_FREE, 0, (w >> 10) + 1), __ATOMIC_RELEASE);
    for (int i = 0; i < MAX_PROBE; i++) {
        uint64_t b = (home + i) & g->mask;
        uint32_t v = g->buckets[b];
        if (v == 0) break;
        if (v == slot + 1) {
            delete_bucket(g, b);
            break;
        }
    }
    Py_RETURN_NONE;
}

/* set_ready(slot): a slot being stored becomes readable (same generation). */
static PyObject *IndexTable_set_ready(IndexTable *self, PyObject *arg) {
    unsigned long long slot = PyLong_AsUnsignedLongLong(arg);
    if (slot == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (check_slot(self, slot) < 0) return NULL;
    uint64_t w = self->g.meta[slot];
    if ((w & 3) == STATE_STORING)
        __atomic_store_n(&self->g.meta[slot], (w & ~(uint64_t)3) | STATE_READY, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *IndexTable_key_of(IndexTable *self, PyObject *arg) {
    unsigned long long slot = PyLong_AsUnsignedLongLong(arg);
    if (slot == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (check_slot(self, slot) < 0) return NULL;
    uint64_t w = self->g.meta[slot];
    if ((w & 3) == STATE_FREE) return PyBytes_FromStringAndSize("", 0);
    return PyBytes_FromStringAndSize((char *)self->g.keys + slot * self->g.width,
                                     (Py_ssize_t)((w >> 2) & 0xFF));
}

/* reachable(slots) -> bytes: per slot id (int64, native order), 1 when a lookup of the key
   it holds finds that very slot (a warm restart's check of an adopted index), else 0. */
static PyObject *IndexTable_reachable(IndexTable *self, PyObject *arg) {
    Py_buffer slots;
    if (check_bound(self) < 0) return NULL;
    if (!PyArg_Parse(arg, "y*", &slots)) return NULL;
    Py_ssize_t n = slots.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out != NULL) {
        Geometry *g = &self->g;
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        const int64_t *src = (const int64_t *)slots.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = src[i];
            dst[i] = 0;
            if (s < 0 || (uint64_t)s >= g->capacity) continue;
            uint64_t w = load_acquire64(&g->meta[s]), word;
            Py_ssize_t len = (Py_ssize_t)((w >> 2) & 0xFF);
            if ((w & 3) == STATE_FREE || len == 0 || len > g->width) continue;
            dst[i] = probe(g, g->keys + (uint64_t)s * g->width, len, &word) == s;
        }
    }
    PyBuffer_Release(&slots);
    return out;
}

static PyObject *IndexTable_release(IndexTable *self, PyObject *unused) {
    geometry_release(&self->g);
    Py_RETURN_NONE;
}

static PyMethodDef IndexTable_methods[] = {
    {"find", (PyCFunction)IndexTable_find, METH_O, "find(key) -> slot or -1"},
    {"insert", (PyCFunction)IndexTable_insert, METH_VARARGS, "insert(slot, key) -> bool"},
    {"remove", (PyCFunction)IndexTable_remove, METH_O, "remove(slot)"},
    {"key_of", (PyCFunction)IndexTable_key_of, METH_O, "key_of(slot) -> bytes (empty if free)"},
    {"set_ready", (PyCFunction)IndexTable_set_ready, METH_O, "set_ready(slot): storing -> ready"},
    {"reachable", (PyCFunction)IndexTable_reachable, METH_O,
     "reachable(int64 slots) -> bytes: 1 where a lookup of the slot's key finds it"},
    {"release", (PyCFunction)IndexTable_release, METH_NOARGS, "let go of the mapping"},
    {NULL}};

static PyMemberDef IndexTable_members[] = {
    {"overflows", T_ULONGLONG, offsetof(IndexTable, overflows), 0,
     "keys that found no bucket within MAX_PROBE"},
    {NULL}};

static PyTypeObject IndexTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvd_proto._native.IndexTable",
    .tp_basicsize = sizeof(IndexTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The daemon's writes of a shared index (see kvd_proto/native.py)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)IndexTable_init,
    .tp_dealloc = (destructor)IndexTable_dealloc,
    .tp_methods = IndexTable_methods,
    .tp_members = IndexTable_members,
};

/* ---------------------------------------------------------------- records */

/* ---------------------------------------------------------------- wake-ups */

/* eventfd_signal(fd) -> bool: add 1 to an eventfd (non-blocking) while holding the GIL. The
 * engine's scheduler thread wakes an idle daemon this way: os.eventfd_write releases the GIL
 * around its write(), and any other thread of the engine that wants the GIL then runs first
 * (measured: ~1.5 ms of the scheduler's step per wake-up). False: the counter is full (the
 * daemon is woken anyway). */
static PyObject *native_eventfd_signal(PyObject *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    uint64_t one = 1;
    ssize_t n = write((int)fd, &one, sizeof one);
    if (n == (ssize_t)sizeof one) Py_RETURN_TRUE;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) Py_RETURN_FALSE;
    if (n >= 0) errno = EIO;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* fence(): a full memory barrier (kvd_proto/barrier.py): the stores before it are visible to
 * other processes before the loads after it. One instruction here; the pure-Python twin takes
 * and releases a lock (two calls and a locked instruction). */
static PyObject *native_fence(PyObject *self, PyObject *unused) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"crc32", native_crc32, METH_O, "crc32(data) -> zlib.crc32(data)"},
    {"fingerprint", native_fingerprint, METH_O,
     "fingerprint(key) -> the key's held-below fingerprint (kvd_proto/below_layout.py)"},
    {"fence", native_fence, METH_NOARGS,
     "fence() -> None: a full memory barrier (kvd_proto/barrier.py)"},
    {"eventfd_signal", native_eventfd_signal, METH_O,
     "eventfd_signal(fd) -> bool: add 1 to a non-blocking eventfd without releasing the GIL"},
    {"keys_block", native_keys_block, METH_O, "keys_block(keys) -> a record's keys field"},
    {"keys_record", (PyCFunction)(void (*)(void))native_keys_record, METH_FASTCALL,
     "keys_record(kind, prefix, req_id, keys, with_positions, positions, index, offsets) -> "
     "one encoded record (kvd_proto/_records.c)"},
    {"key_positions", (PyCFunction)(void (*)(void))native_key_positions, METH_FASTCALL,
     "key_positions(position, keys) -> range, list or None: the keys' token positions "
     "(kvd_proto/_steps.c)"},
    {"same_set", (PyCFunction)(void (*)(void))native_same_set, METH_FASTCALL,
     "same_set(a, b) -> True only when the sets' tables hold the same objects in every entry "
     "(kvd_proto/_steps.c)"},
    {"ring_write", (PyCFunction)(void (*)(void))native_ring_write, METH_FASTCALL,
     "ring_write(data, tail, free, max_record, records) -> (count, new_tail) or None "
     "(kvd_proto/_rings.c)"},
    {"ring_read", (PyCFunction)(void (*)(void))native_ring_read, METH_FASTCALL,
     "ring_read(data, head, tail, max_record, strict[, limit]) -> (records, new_head, error "
     "or None) (kvd_proto/_rings.c)"},
    {"decode_keyed", (PyCFunction)(void (*)(void))native_decode_keyed, METH_FASTCALL,
     "decode_keyed(kind, payload, max_string, max_keys, max_key_bytes) -> the fields of a "
     "STORE, COMPLETE_STORE, PIN or COMPLETE_LOAD record, or None (kvd_proto/_decode.c)"},
    {"list_discard", (PyCFunction)(void (*)(void))native_list_discard, METH_FASTCALL,
     "list_discard(items, obj) -> bool: remove obj (by identity first) from a list "
     "(kvd_proto/_grants.c)"},
    {NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvd_proto._native",
    "The shared index's per-key loops and the channel's hot records, compiled (pure-Python twins in kvd_proto/native.py).", -1,
    module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    ahead_attr = PyUnicode_InternFromString("_offload_key_positions");
    if (ahead_attr == NULL) return NULL;
    if (PyType_Ready(&LookupsType) < 0 || PyType_Ready(&IndexTableType) < 0 ||
        PyType_Ready(&KeptTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Lookups", (PyObject *)&LookupsType) < 0 ||
        PyModule_AddObjectRef(m, "IndexTable", (PyObject *)&IndexTableType) < 0 ||
        PyModule_AddObjectRef(m, "KeptTable", (PyObject *)&KeptTableType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PROBE", MAX_PROBE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
