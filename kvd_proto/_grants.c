/* kvd_proto._native, part five: a session's reserve topped up (GRANTED) in one pass.
 *
 * The daemon tops an engine's reserve up unasked, a few hundred slots a step when the engine
 * stores flat out, and (RESERVE flag 2) names the evicted block each slot still holds, so the
 * engine keeps hitting it until it stores into the slot (docs/attach.md, "Kept blocks in
 * granted slots"). Read in Python (a slice per key, a list of offsets, two dict updates) that
 * was ~100 us of the scheduler thread a step at 3,000 sessions; here it is one pass:
 *
 *   granted_apply(payload, slots, kept, kept_at) -> count or None
 *       For a GRANTED of the two shapes the daemon writes (offsets alone; offsets, then the
 *       kept blocks' indices and their fixed-width keys), exactly as kvd_proto/native.py's
 *       py_granted_apply does: the offsets go in at the front of `slots`, each kept block as
 *       kept[key] = offset and kept_at[offset] = key. None (nothing changed) for any other
 *       shape: the caller decodes it with the checked decoder (kvd_proto/records.py), which
 *       says what is wrong.
 *
 *   kept_compact(slots, kept, kept_at, restoring) -> None
 *       Forget the kept blocks of slots no longer in `slots` (stored into, given back), as
 *       py_kept_compact does: kept_at keeps its entries whose offset is held, in order; kept
 *       is rebuilt from them, then the keys being taken back (`restoring`: (seq, key) pairs
 *       whose kept value is negative) are kept as they were.
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
    if (nargs != 4 || !PyBytes_Check(args[0]) || !PyList_Check(args[1]) ||
        !PyDict_Check(args[2]) || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "granted_apply(payload: bytes, slots: list, kept: dict, kept_at: dict)");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    PyObject *slots = args[1], *kept = args[2], *kept_at = args[3];
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
        if (key == NULL || PyDict_SetItem(kept, key, offset) < 0 ||
            PyDict_SetItem(kept_at, offset, key) < 0) {
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
    if (nargs != 4 || !PyDict_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "kept_compact(slots, kept: dict, kept_at: dict, restoring)");
        return NULL;
    }
    PyObject *kept = args[1], *kept_at = args[2];
    PyObject *held = NULL, *still = NULL, *restoring = NULL, *iter = NULL, *item = NULL;
    PyObject *zero = NULL, *result = NULL;
    if ((held = PySet_New(args[0])) == NULL || (still = PyDict_New()) == NULL ||
        (restoring = PyDict_New()) == NULL || (zero = PyLong_FromLong(0)) == NULL)
        goto done;
    Py_ssize_t pos = 0;
    PyObject *offset, *key;
    while (PyDict_Next(kept_at, &pos, &offset, &key)) {
        int in = PySet_Contains(held, offset);
        if (in < 0 || (in && PyDict_SetItem(still, offset, key) < 0)) goto done;
    }
    if ((iter = PyObject_GetIter(args[3])) == NULL) goto done;
    while ((item = PyIter_Next(iter)) != NULL) {
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "restoring holds (seq, key) pairs");
            goto done;
        }
        PyObject *k = PyTuple_GET_ITEM(item, 1);
        PyObject *value = PyDict_GetItemWithError(kept, k);     /* borrowed */
        if (value == NULL && PyErr_Occurred()) goto done;
        int negative = value == NULL ? 0 : PyObject_RichCompareBool(value, zero, Py_LT);
        if (negative < 0 || (negative && PyDict_SetItem(restoring, k, value) < 0)) goto done;
        Py_CLEAR(item);
    }
    if (PyErr_Occurred()) goto done;
    PyDict_Clear(kept);
    pos = 0;
    while (PyDict_Next(still, &pos, &offset, &key))
        if (PyDict_SetItem(kept, key, offset) < 0) goto done;
    if (PyDict_Update(kept, restoring) < 0) goto done;
    PyDict_Clear(kept_at);
    if (PyDict_Update(kept_at, still) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(item);
    Py_XDECREF(iter);
    Py_XDECREF(zero);
    Py_XDECREF(restoring);
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
