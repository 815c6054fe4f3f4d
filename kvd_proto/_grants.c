/* kvd_proto._native, part five: a session's reserve topped up (GRANTED) in one pass.
 *
 * The daemon tops an engine's reserve up unasked, a few hundred slots a step when the engine
 * stores flat out, and (RESERVE flag 2) names the evicted block each slot still holds, so the
 * engine keeps hitting it until it stores into the slot (docs/attach.md, "Kept blocks in
 * granted slots"). Read in Python (a slice per key, a list of offsets, two dict updates) that
 * was ~100 us of the scheduler thread a step at 3,000 sessions; here it is one pass:
 *
 *   granted_apply(payload, slots, kept) -> count or None
 *       For a GRANTED of the two shapes the daemon writes (offsets alone; offsets, then the
 *       kept blocks' indices and their fixed-width keys), exactly as kvd_proto/native.py's
 *       py_granted_apply does: the offsets go in at the front of `slots`, each kept block as
 *       kept[key] = offset (the very offset object put in `slots`). None (nothing changed)
 *       for any other shape: the caller decodes it with the checked decoder
 *       (kvd_proto/records.py), which says what is wrong.
 *
 *   kept_compact(slots, kept) -> None
 *       Forget the kept blocks whose slots are no longer in `slots` (stored into, given back),
 *       as py_kept_compact does: kept keeps, in order, its entries whose offset is held or
 *       negative (a block being taken back).
 *
 *   list_discard(items, obj) -> bool (below): a kept block's slot taken back.
 *
 * tests/unit/test_grants.py holds each equal to their twins on random and broken payloads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_records.h"

#define MAX_KEY_BYTES 128   /* kvd_proto/wire.py MAX_KEY_BYTES */
#define KEYS_HEADER 8       /* u32 count, u16 width, u16 zero (records.py _KEYS) */

static uint32_t read_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

PyObject *native_granted_apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyList_Check(args[1]) ||
        !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "granted_apply(payload: bytes, slots: list, kept: dict)");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    PyObject *slots = args[1], *kept = args[2];
    if (size < 4) Py_RETURN_NONE;
    Py_ssize_t count = (Py_ssize_t)read_u32(p);
    Py_ssize_t at = 4 + 8 * count;
    Py_ssize_t m = 0, width = 0, keys_start = 0;
    const unsigned char *index = NULL;
    if (size != at) {                       /* the kept blocks' trailer, or another shape */
        if (at + 4 + KEYS_HEADER > size) Py_RETURN_NONE;
        Py_ssize_t mm = (Py_ssize_t)read_u32(p + at);
        Py_ssize_t keys_at = at + 4 + 4 * mm;
        if (mm > count || keys_at + KEYS_HEADER > size) Py_RETURN_NONE;
        uint32_t n = read_u32(p + keys_at);
        uint16_t w, zero;
        memcpy(&w, p + keys_at + 4, 2);
        memcpy(&zero, p + keys_at + 6, 2);
        keys_start = keys_at + KEYS_HEADER;
        if ((Py_ssize_t)n != mm || zero || w == 0 || w > MAX_KEY_BYTES ||
            keys_start + mm * (Py_ssize_t)w != size)
            Py_RETURN_NONE;
        index = p + at + 4;
        for (Py_ssize_t i = 0; i < mm; i++)
            if ((Py_ssize_t)read_u32(index + 4 * i) >= count) Py_RETURN_NONE;
        m = mm;
        width = w;
    }
    PyObject *offsets = PyList_New(count);
    if (offsets == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t v;
        memcpy(&v, p + 4 + 8 * i, 8);
        PyObject *o = PyLong_FromUnsignedLongLong(v);
        if (o == NULL) {
            Py_DECREF(offsets);
            return NULL;
        }
        PyList_SET_ITEM(offsets, i, o);
    }
    if (PyList_SetSlice(slots, 0, 0, offsets) < 0) {
        Py_DECREF(offsets);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *offset = PyList_GET_ITEM(offsets, (Py_ssize_t)read_u32(index + 4 * i));
        PyObject *key = PyBytes_FromStringAndSize((const char *)p + keys_start + i * width,
                                                  width);
        if (key == NULL || PyDict_SetItem(kept, key, offset) < 0) {
            Py_XDECREF(key);
            Py_DECREF(offsets);
            return NULL;
        }
        Py_DECREF(key);
    }
    Py_DECREF(offsets);
    return PyLong_FromSsize_t(count);
}

PyObject *native_kept_compact(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "kept_compact(slots, kept: dict)");
        return NULL;
    }
    PyObject *kept = args[1];
    PyObject *held = NULL, *still = NULL, *zero = NULL, *result = NULL;
    if ((held = PySet_New(args[0])) == NULL || (still = PyDict_New()) == NULL ||
        (zero = PyLong_FromLong(0)) == NULL)
        goto done;
    Py_ssize_t pos = 0;
    PyObject *key, *offset;
    while (PyDict_Next(kept, &pos, &key, &offset)) {
        int keep = PySet_Contains(held, offset);
        if (keep == 0) keep = PyObject_RichCompareBool(offset, zero, Py_LT);
        if (keep < 0 || (keep && PyDict_SetItem(still, key, offset) < 0)) goto done;
    }
    PyDict_Clear(kept);
    if (PyDict_Update(kept, still) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(zero);
    Py_XDECREF(still);
    Py_XDECREF(held);
    return result;
}

/* list_discard(items, obj) -> bool: remove `obj` from the list `items` (the element that is
 * `obj` itself, else the first equal to it); False when none is. A reserve takes a kept
 * block's slot back from the middle of its ~2,000 slots by the very offset object it granted:
 * found by identity, the scan costs no comparison call (list.remove's did, ~10 us a slot).
 * Twin: py_list_discard (list.remove; the same list after, where no two elements are equal). */
PyObject *native_list_discard(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "list_discard(items: list, obj)");
        return NULL;
    }
    PyObject *items = args[0], *obj = args[1];
    Py_ssize_t n = PyList_GET_SIZE(items), at = -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyList_GET_ITEM(items, i) == obj) {
            at = i;
            break;
        }
    for (Py_ssize_t i = 0; at < 0 && i < PyList_GET_SIZE(items); i++) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(items, i));
        int same = PyObject_RichCompareBool(item, obj, Py_EQ);
        Py_DECREF(item);
        if (same < 0) return NULL;
        if (same) at = i;
    }
    if (at < 0) Py_RETURN_FALSE;
    if (PyList_SetSlice(items, at, at + 1, NULL) < 0) return NULL;
    Py_RETURN_TRUE;
}
