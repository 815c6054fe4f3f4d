/* kvd_proto._native, part two: the channel's hot records, encoded in one pass.
 *
 * The engine's scheduler thread writes a record per offload call (a store, a pin, a completed
 * load or store) carrying up to hundreds of keys with their positions and slots
 * (kvd_proto/records.py has the layout, docs/attach.md the table). Built from Python parts
 * (struct packs, arrays, joins) one such record costs 5-10 us; here it is one allocation and
 * a few copies. The pure-Python twin is kvd_proto/native.py's `py_keys_record`; the tests
 * check that both write the same bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_records.h"

#define RECORD_HEADER 8
#define ALIGN 8
#define MAX_STR 0xFFFF

/* ---------------------------------------------------------------- the keys field */

/* The keys field's size, and whether every key has the same non-zero width. */
static int keys_measure(PyObject **items, Py_ssize_t n, Py_ssize_t *size, int *fixed,
                        Py_ssize_t *width) {
    if (n > 0xFFFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "too many keys for one record");
        return -1;
    }
    Py_ssize_t total = 0, w = -1;
    int same = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(items[i])) {
            PyErr_SetString(PyExc_TypeError, "keys must be bytes");
            return -1;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(items[i]);
        if (len > 255) {
            PyErr_SetString(PyExc_ValueError, "a key is longer than 255 bytes");
            return -1;
        }
        if (w < 0) w = len;
        else if (len != w) same = 0;
        total += len;
    }
    if (n == 0 || w == 0) same = same && n == 0;
    *fixed = same;
    *width = same && n ? w : 0;
    *size = 8 + (same ? 0 : n) + total;
    return 0;
}

static unsigned char *keys_write(unsigned char *p, PyObject **items, Py_ssize_t n, int fixed,
                                 Py_ssize_t width) {
    uint32_t count = (uint32_t)n;
    uint16_t w = (uint16_t)width, zero = 0;
    memcpy(p, &count, 4);
    memcpy(p + 4, &w, 2);
    memcpy(p + 6, &zero, 2);
    p += 8;
    if (!fixed)
        for (Py_ssize_t i = 0; i < n; i++) *p++ = (unsigned char)PyBytes_GET_SIZE(items[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = PyBytes_GET_SIZE(items[i]);
        memcpy(p, PyBytes_AS_STRING(items[i]), (size_t)len);
        p += len;
    }
    return p;
}

PyObject *native_keys_block(PyObject *self, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), size, width;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = NULL;
    int fixed;
    if (keys_measure(items, n, &size, &fixed, &width) == 0) {
        out = PyBytes_FromStringAndSize(NULL, size);
        if (out != NULL)
            keys_write((unsigned char *)PyBytes_AS_STRING(out), items, n, fixed, width);
    }
    Py_DECREF(seq);
    return out;
}

/* ---------------------------------------------------------------- integer columns */

/* A column of integers: a range (read arithmetically: positions usually are one) or any
 * sequence (through PySequence_Fast). */
typedef struct {
    PyObject *fast;
    Py_ssize_t n;
    int is_range;
    long long start, step;
} Column;

static int column_open(Column *c, PyObject *obj, const char *what) {
    c->fast = NULL;
    c->is_range = 0;
    if (PyRange_Check(obj)) {
        PyObject *start = PyObject_GetAttrString(obj, "start");
        PyObject *step = start ? PyObject_GetAttrString(obj, "step") : NULL;
        c->n = PyObject_Length(obj);
        if (step != NULL) {
            c->start = PyLong_AsLongLong(start);
            c->step = PyLong_AsLongLong(step);
        }
        Py_XDECREF(start);
        Py_XDECREF(step);
        if (step == NULL || c->n < 0 || PyErr_Occurred()) return -1;
        c->is_range = 1;
        return 0;
    }
    c->fast = PySequence_Fast(obj, what);
    if (c->fast == NULL) return -1;
    c->n = PySequence_Fast_GET_SIZE(c->fast);
    return 0;
}

static void column_close(Column *c) { Py_CLEAR(c->fast); }

/* Item i as a signed 64-bit value. */
static int column_i64(const Column *c, Py_ssize_t i, long long *out) {
    if (c->is_range) {
        long long v;
        if (__builtin_mul_overflow((long long)i, c->step, &v) ||
            __builtin_add_overflow(v, c->start, &v)) {
            PyErr_SetString(PyExc_OverflowError, "a value does not fit 64 bits");
            return -1;
        }
        *out = v;
        return 0;
    }
    *out = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(c->fast, i));
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Item i as an unsigned value of at most `max`. */
static int column_u64(const Column *c, Py_ssize_t i, unsigned long long max,
                      unsigned long long *out) {
    if (c->is_range) {
        long long v;
        if (column_i64(c, i, &v) < 0) return -1;
        if (v < 0 || (unsigned long long)v > max) goto range;
        *out = (unsigned long long)v;
        return 0;
    }
    PyObject *item = PySequence_Fast_GET_ITEM(c->fast, i);
    if (!PyLong_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "an integer is required");
        return -1;
    }
    *out = PyLong_AsUnsignedLongLong(item);
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (*out > max) goto range;
    return 0;
range:
    PyErr_SetString(PyExc_OverflowError, "a value out of its field's range");
    return -1;
}

/* ---------------------------------------------------------------- the record */

/* keys_record(kind, prefix, req_id, keys, with_positions, positions, index, offsets) -> bytes
 *
 * One record: header (u32 length, u16 kind, u16 0), then `prefix` (bytes, as given), the
 * request (u16 length + UTF-8; None: no such field), the keys field, with_positions: the
 * optional positions column (u8 0, or u8 1 + one i64 per key), `index` (None: no field; else
 * u32 count + u32 each), `offsets` (None: no field; else u64 each), zeros to a multiple of 8. */
PyObject *native_keys_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "keys_record(kind, prefix, req_id, keys, "
                        "with_positions, positions, index, offsets)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    if (kind < 0 || kind > 0xFFFF) {
        PyErr_SetString(PyExc_OverflowError, "record kind out of range");
        return NULL;
    }
    PyObject *prefix = args[1], *req_id = args[2], *keys = args[3];
    int with_positions = PyObject_IsTrue(args[4]);
    if (with_positions < 0) return NULL;
    PyObject *positions = args[5], *index = args[6], *offsets = args[7];
    if (!PyBytes_Check(prefix)) {
        PyErr_SetString(PyExc_TypeError, "prefix must be bytes");
        return NULL;
    }
    const char *req = NULL;
    Py_ssize_t req_len = 0;
    if (req_id != Py_None) {
        req = PyUnicode_AsUTF8AndSize(req_id, &req_len);
        if (req == NULL) return NULL;
        if (req_len > MAX_STR) {
            PyErr_SetString(PyExc_ValueError, "the request id is longer than 65535 bytes");
            return NULL;
        }
    }
    PyObject *out = NULL;
    Column pos = {0}, idx = {0}, off = {0};
    int have_pos = 0, have_idx = 0, have_off = 0;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), keys_size, width;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int fixed;
    if (keys_measure(items, n, &keys_size, &fixed, &width) < 0) goto done;
    if (with_positions && positions != Py_None) {
        if (column_open(&pos, positions, "positions must be a sequence") < 0) goto done;
        have_pos = pos.n > 0;
        if (have_pos && pos.n != n) {
            PyErr_SetString(PyExc_ValueError, "one position per key");
            goto done;
        }
    }
    if (index != Py_None) {
        if (column_open(&idx, index, "index must be a sequence") < 0) goto done;
        have_idx = 1;
        if (idx.n > 0xFFFFFFFF) {
            PyErr_SetString(PyExc_ValueError, "index too long");
            goto done;
        }
    }
    if (offsets != Py_None) {
        if (column_open(&off, offsets, "offsets must be a sequence") < 0) goto done;
        have_off = 1;
    }
    Py_ssize_t size = RECORD_HEADER + PyBytes_GET_SIZE(prefix) + (req ? 2 + req_len : 0) +
                      keys_size + (with_positions ? 1 + (have_pos ? 8 * n : 0) : 0) +
                      (have_idx ? 4 + 4 * idx.n : 0) + (have_off ? 8 * off.n : 0);
    Py_ssize_t padded = (size + ALIGN - 1) & ~(Py_ssize_t)(ALIGN - 1);
    if (size > 0xFFFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "record too large");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, padded);
    if (out == NULL) goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    uint32_t len32 = (uint32_t)size;
    uint16_t kind16 = (uint16_t)kind, zero = 0;
    memcpy(p, &len32, 4);
    memcpy(p + 4, &kind16, 2);
    memcpy(p + 6, &zero, 2);
    p += RECORD_HEADER;
    memcpy(p, PyBytes_AS_STRING(prefix), (size_t)PyBytes_GET_SIZE(prefix));
    p += PyBytes_GET_SIZE(prefix);
    if (req) {
        uint16_t l16 = (uint16_t)req_len;
        memcpy(p, &l16, 2);
        memcpy(p + 2, req, (size_t)req_len);
        p += 2 + req_len;
    }
    p = keys_write(p, items, n, fixed, width);
    if (with_positions) {
        *p++ = (unsigned char)have_pos;
        for (Py_ssize_t i = 0; have_pos && i < n; i++, p += 8) {
            long long v;
            if (column_i64(&pos, i, &v) < 0) goto fail;
            memcpy(p, &v, 8);
        }
    }
    if (have_idx) {
        uint32_t count = (uint32_t)idx.n;
        memcpy(p, &count, 4);
        p += 4;
        for (Py_ssize_t i = 0; i < idx.n; i++, p += 4) {
            unsigned long long v;
            if (column_u64(&idx, i, 0xFFFFFFFFULL, &v) < 0) goto fail;
            uint32_t v32 = (uint32_t)v;
            memcpy(p, &v32, 4);
        }
    }
    for (Py_ssize_t i = 0; have_off && i < off.n; i++, p += 8) {
        unsigned long long v;
        if (column_u64(&off, i, UINT64_MAX, &v) < 0) goto fail;
        memcpy(p, &v, 8);
    }
    memset(p, 0, (size_t)(padded - size));
    goto done;
fail:
    Py_CLEAR(out);
done:
    column_close(&pos);
    column_close(&idx);
    column_close(&off);
    Py_DECREF(seq);
    return out;
}
