/* kvd_proto._native, part four: a channel ring's appends and reads, compiled.
 *
 * The engine's scheduler thread appends a step's records (20-40 of them) to its up ring at the
 * step's end and reads the daemon's answers at the next step's start (kvd_proto/channel.py has
 * the layout: u32 length, u16 kind, u16 0, payload, zeros to a multiple of 8; a PAD filler
 * ends the ring where a record would cross it). In Python each costs a few lists, a join and
 * a slice copy per step, or a header unpack and a slice per record; here one pass. The Python
 * twins are RingWriter._write_runs and RingReader.read (the tests compare both).
 *
 *   ring_write(data, tail, free, max_record, records) -> (count, new_tail) or None
 *       Append records at position `tail` of the ring `data` (a writable buffer, a power of
 *       two bytes), as many as fit in `free` bytes, in order. None (nothing written): a record
 *       breaks the ring's rules (the caller's Python path says which).
 *   ring_read(data, head, tail, max_record, strict[, limit])
 *           -> (records, new_head, error or None)
 *       Every record published between `head` and `tail` (at most `limit` of them, when
 *       given and >= 0): [(kind, payload bytes)], PADs skipped. Where the ring holds
 *       something that cannot be (a torn or hostile writer), reading stops there; `error`
 *       says what (a strict reader raises it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_rings.h"

#define HEADER 8
#define ALIGN 8
#define PAD 0

static int ring_buffer(PyObject *obj, Py_buffer *view, int writable) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    Py_ssize_t n = view->len;
    if (n < 4096 || (n & (n - 1))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a ring is a power of two bytes, at least 4096");
        return -1;
    }
    return 0;
}

static int as_u64(PyObject *obj, unsigned long long *out) {
    *out = PyLong_AsUnsignedLongLong(obj);
    return *out == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

PyObject *native_ring_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "ring_write(data, tail, free, max_record, records: list)");
        return NULL;
    }
    unsigned long long tail, free, max_record;
    if (as_u64(args[1], &tail) < 0 || as_u64(args[2], &free) < 0 || as_u64(args[3], &max_record) < 0)
        return NULL;
    PyObject *records = args[4];
    Py_ssize_t count = PyList_GET_SIZE(records);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *r = PyList_GET_ITEM(records, i);
        if (!PyBytes_Check(r)) Py_RETURN_NONE;
        Py_ssize_t n = PyBytes_GET_SIZE(r);
        if (n == 0 || (unsigned long long)n > max_record || n % ALIGN) Py_RETURN_NONE;
    }
    Py_buffer view;
    if (ring_buffer(args[0], &view, 1) < 0) return NULL;
    unsigned char *data = view.buf;
    uint64_t size = (uint64_t)view.len, mask = size - 1;
    if (free > size) free = size;
    Py_ssize_t done = 0;
    for (; done < count; done++) {
        PyObject *r = PyList_GET_ITEM(records, done);
        uint64_t n = (uint64_t)PyBytes_GET_SIZE(r), at = tail & mask;
        if (at + n > size) {                 /* a filler to the ring's end, then from 0 */
            uint64_t wrap = size - at;
            if (wrap + n > free) break;
            uint32_t len32 = (uint32_t)wrap;
            uint16_t kind = PAD, zero = 0;
            memcpy(data + at, &len32, 4);
            memcpy(data + at + 4, &kind, 2);
            memcpy(data + at + 6, &zero, 2);
            tail += wrap;
            free -= wrap;
            at = 0;
        }
        if (n > free) break;
        memcpy(data + at, PyBytes_AS_STRING(r), (size_t)n);
        tail += n;
        free -= n;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(nK)", done, tail);
}

PyObject *native_ring_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "ring_read(data, head, tail, max_record, strict[, limit])");
        return NULL;
    }
    unsigned long long head, tail, max_record;
    if (as_u64(args[1], &head) < 0 || as_u64(args[2], &tail) < 0 || as_u64(args[3], &max_record) < 0)
        return NULL;
    Py_ssize_t limit = -1;                 /* records at most (-1: every one published) */
    if (nargs == 6) {
        limit = PyLong_AsSsize_t(args[5]);
        if (limit == -1 && PyErr_Occurred()) return NULL;
    }
    int strict = PyObject_IsTrue(args[4]);
    if (strict < 0) return NULL;
    Py_buffer view;
    if (ring_buffer(args[0], &view, 0) < 0) return NULL;
    const unsigned char *data = view.buf;
    uint64_t size = (uint64_t)view.len, mask = size - 1;
    PyObject *out = PyList_New(0), *error = NULL;
    if (out == NULL) goto fail;
    uint64_t available = tail - head;
    char message[160];
    message[0] = 0;
    if (available > size) {
        snprintf(message, sizeof message, "the producer's tail is %lld bytes past the head of "
                 "a %llu-byte ring", (long long)available, (unsigned long long)size);
        available = 0;
    }
    while (available >= HEADER && (limit < 0 || PyList_GET_SIZE(out) < limit)) {
        uint64_t at = head & mask;
        uint32_t length;
        uint16_t kind;
        memcpy(&length, data + at, 4);
        memcpy(&kind, data + at + 4, 2);
        uint64_t padded = ((uint64_t)length + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
        if (kind == PAD) {
            if (at + length != size || length % ALIGN || length > available) {
                snprintf(message, sizeof message, "a filler record of %u bytes at %llu does "
                         "not end the ring", length, (unsigned long long)at);
                break;
            }
            head += length;
            available -= length;
            continue;
        }
        if (length < HEADER || padded > max_record || at + padded > size || padded > available) {
            snprintf(message, sizeof message, "a record of %u bytes at %llu (with %llu "
                     "published, at most %llu a record)", length, (unsigned long long)at,
                     (unsigned long long)available, max_record);
            break;
        }
        PyObject *item = Py_BuildValue("(iy#)", (int)kind, (const char *)data + at + HEADER,
                                       (Py_ssize_t)(length - HEADER));
        if (item == NULL) goto fail;
        int rc = PyList_Append(out, item);
        Py_DECREF(item);
        if (rc < 0) goto fail;
        head += padded;
        available -= padded;
    }
    if (!message[0] && available && available < HEADER &&
        (limit < 0 || PyList_GET_SIZE(out) < limit))
        snprintf(message, sizeof message, "%llu bytes published, less than a record",
                 (unsigned long long)available);
    PyBuffer_Release(&view);
    if (message[0]) {
        error = PyUnicode_FromString(message);
        if (error == NULL) {
            Py_DECREF(out);
            return NULL;
        }
    } else {
        error = Py_NewRef(Py_None);
    }
    return Py_BuildValue("(NKN)", out, head, error);
fail:
    PyBuffer_Release(&view);
    Py_XDECREF(out);
    return NULL;
}
