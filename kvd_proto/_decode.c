/* kvd_proto._native, part four: the daemon's strict decoding of the hot up records.
 *
 * A stepping engine sends, per step, a store, its completion, a pin and its completion, each
 * carrying its call's keys (kvd_proto/records.py has the layout). Decoded field by field in
 * Python (a Cursor call per field, a slice per key) they were ~14% of the daemon's time with
 * engines stepping flat out. Here one pass checks the same bounds and builds the same fields:
 *
 *   decode_keyed(kind, payload, max_string, max_keys, max_key_bytes) -> fields or None
 *       For STORE, COMPLETE_STORE, PIN and COMPLETE_LOAD: the fields of the record's
 *       NamedTuple in kvd_proto/records.py, in order. None for any other kind and for any
 *       payload that breaks a rule (a bound, a length, a duplicate key or index, text that
 *       is not UTF-8, bytes left over): the caller then decodes it in Python, which says
 *       what is wrong (decode_up). So None never loses a record, and a payload accepted here
 *       is one the Python decoder accepts with the same fields (tested on random and
 *       corrupted records: tests/unit/test_records.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_records.h"

typedef struct {
    const unsigned char *data;
    Py_ssize_t len, at;
    Py_ssize_t max_string, max_keys, max_key_bytes;
} Reader;

/* 0 and *out set, or -1: fewer than n bytes left. */
static int take(Reader *r, Py_ssize_t n, const unsigned char **out) {
    if (n < 0 || n > r->len - r->at) return -1;
    *out = r->data + r->at;
    r->at += n;
    return 0;
}

static int u8(Reader *r, unsigned *v) {
    const unsigned char *p;
    if (take(r, 1, &p) < 0) return -1;
    *v = p[0];
    return 0;
}

static int u32(Reader *r, uint32_t *v) {
    const unsigned char *p;
    if (take(r, 4, &p) < 0) return -1;
    memcpy(v, p, 4);
    return 0;
}

static int u64(Reader *r, uint64_t *v) {
    const unsigned char *p;
    if (take(r, 8, &p) < 0) return -1;
    memcpy(v, p, 8);
    return 0;
}

/* A u16-prefixed UTF-8 string (new reference), or NULL with no error set (a rule broken) or
 * with one set (no memory). */
static PyObject *text(Reader *r) {
    const unsigned char *p;
    if (take(r, 2, &p) < 0) return NULL;
    uint16_t n;
    memcpy(&n, p, 2);
    if (n > r->max_string || take(r, n, &p) < 0) return NULL;
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
    if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return s;
}

/* The keys field: a list of distinct bytes (new reference), or NULL as `text`. */
static PyObject *keys(Reader *r) {
    const unsigned char *p;
    if (take(r, 8, &p) < 0) return NULL;
    uint32_t n;
    uint16_t width, zero;
    memcpy(&n, p, 4);
    memcpy(&width, p + 4, 2);
    memcpy(&zero, p + 6, 2);
    if ((Py_ssize_t)n > r->max_keys || zero || width > r->max_key_bytes) return NULL;
    const unsigned char *lengths = NULL, *bytes;
    Py_ssize_t total;
    if (width) {
        total = (Py_ssize_t)n * width;
    } else {
        if (take(r, n, &lengths) < 0) return NULL;
        total = 0;
        for (uint32_t i = 0; i < n; i++) {
            if (lengths[i] == 0 || lengths[i] > r->max_key_bytes) return NULL;
            total += lengths[i];
        }
    }
    if (take(r, total, &bytes) < 0) return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (uint32_t i = 0; i < n; i++) {
        Py_ssize_t len = width ? width : lengths[i];
        PyObject *key = PyBytes_FromStringAndSize((const char *)bytes, len);
        if (key == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, key);
        bytes += len;
    }
    if (n > 1) {                                  /* no key named twice */
        PyObject *set = PySet_New(list);
        if (set == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        Py_ssize_t distinct = PySet_GET_SIZE(set);
        Py_DECREF(set);
        if (distinct != (Py_ssize_t)n) {
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

/* n little-endian values of `size` bytes (4: unsigned, 8: signed or not) as a list of ints. */
static PyObject *values(Reader *r, Py_ssize_t n, int size, int is_signed) {
    const unsigned char *p;
    if (n > PY_SSIZE_T_MAX / 8 || take(r, n * size, &p) < 0) return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++, p += size) {
        PyObject *v;
        if (size == 4) {
            uint32_t x;
            memcpy(&x, p, 4);
            v = PyLong_FromUnsignedLong(x);
        } else {
            uint64_t x;
            memcpy(&x, p, 8);
            v = is_signed ? PyLong_FromLongLong((long long)x) : PyLong_FromUnsignedLongLong(x);
        }
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, v);
    }
    return list;
}

/* The positions field: None (flag 0), or n signed values (any other flag, as Python reads
 * it). Returns 0, or -1 with *out unset. */
static int positions(Reader *r, Py_ssize_t n, PyObject **out) {
    unsigned flag;
    if (u8(r, &flag) < 0) return -1;
    if (!flag) {
        *out = Py_NewRef(Py_None);
        return 0;
    }
    *out = values(r, n, 8, 1);
    return *out == NULL ? -1 : 0;
}

/* The granted part of a STORE: m key indices (u32, each < n, distinct), then m offsets. */
static int granted(Reader *r, PyObject *keys_list, PyObject **granted_keys, PyObject **offsets) {
    uint32_t m;
    Py_ssize_t n = PyList_GET_SIZE(keys_list);
    if (u32(r, &m) < 0 || (Py_ssize_t)m > n) return -1;
    const unsigned char *p;
    if (take(r, (Py_ssize_t)m * 4, &p) < 0) return -1;
    char stack_seen[512];
    char *seen = n <= (Py_ssize_t)sizeof stack_seen ? stack_seen : PyMem_Calloc((size_t)n, 1);
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (seen == stack_seen) memset(seen, 0, (size_t)n);
    PyObject *chosen = PyList_New(m);
    int rc = -1;
    if (chosen == NULL) goto out;
    for (uint32_t j = 0; j < m; j++) {
        uint32_t i;
        memcpy(&i, p + 4 * (size_t)j, 4);
        if ((Py_ssize_t)i >= n || seen[i]) goto out;
        seen[i] = 1;
        PyList_SET_ITEM(chosen, j, Py_NewRef(PyList_GET_ITEM(keys_list, i)));
    }
    *offsets = values(r, m, 8, 0);
    if (*offsets == NULL) goto out;
    *granted_keys = chosen;
    chosen = NULL;
    rc = 0;
out:
    Py_XDECREF(chosen);
    if (seen != stack_seen) PyMem_Free(seen);
    return rc;
}

PyObject *native_decode_keyed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "decode_keyed(kind, payload: bytes, max_string, "
                        "max_keys, max_key_bytes)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    Reader r = {(const unsigned char *)PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]), 0,
                PyLong_AsSsize_t(args[2]), PyLong_AsSsize_t(args[3]), PyLong_AsSsize_t(args[4])};
    if (PyErr_Occurred()) return NULL;
    PyObject *req = NULL, *ks = NULL, *pos = NULL, *extra = NULL, *offs = NULL, *result = NULL;
    uint64_t epoch = 0;
    unsigned success = 0;
    switch (kind) {
    case KIND_STORE:
        if ((req = text(&r)) == NULL || (ks = keys(&r)) == NULL ||
            positions(&r, PyList_GET_SIZE(ks), &pos) < 0 || granted(&r, ks, &extra, &offs) < 0)
            goto done;
        break;
    case KIND_COMPLETE_STORE:
        if (u64(&r, &epoch) < 0 || u8(&r, &success) < 0 || success > 1 ||
            (req = text(&r)) == NULL || (ks = keys(&r)) == NULL)
            goto done;
        break;
    case KIND_PIN:
        if ((req = text(&r)) == NULL || (ks = keys(&r)) == NULL ||
            positions(&r, PyList_GET_SIZE(ks), &pos) < 0 ||
            (offs = values(&r, PyList_GET_SIZE(ks), 8, 0)) == NULL)
            goto done;
        break;
    case KIND_COMPLETE_LOAD:
        if (u64(&r, &epoch) < 0 || (req = text(&r)) == NULL || (ks = keys(&r)) == NULL)
            goto done;
        break;
    default:
        goto done;
    }
    if (r.at != r.len) goto done;                /* bytes left over after the last field */
    switch (kind) {
    case KIND_STORE:
        result = PyTuple_Pack(5, req, ks, pos, extra, offs);
        break;
    case KIND_COMPLETE_STORE:
        result = Py_BuildValue("(OOOK)", ks, success ? Py_True : Py_False, req,
                               (unsigned long long)epoch);
        break;
    case KIND_PIN:
        result = PyTuple_Pack(4, ks, req, pos, offs);
        break;
    default:
        result = Py_BuildValue("(OOK)", ks, req, (unsigned long long)epoch);
    }
done:
    Py_XDECREF(req);
    Py_XDECREF(ks);
    Py_XDECREF(pos);
    Py_XDECREF(extra);
    Py_XDECREF(offs);
    if (result == NULL && !PyErr_Occurred()) result = Py_NewRef(Py_None);
    return result;
}
