/* kvd_proto._native, part three: the scheduler's store and load calls, compiled.
 *
 * vLLM's scheduler calls prepare_store and prepare_load a few times a step, between long
 * stretches of its own Python, so every object a call touches is cold: in Python the session's
 * store of 16 keys walked ~25 functions (the index probe, the reserve, the tracker, the record)
 * and cost 15-25 us. Each method here does a call's common case in one pass over the keys,
 * with the same effects on the same Python containers the session's Python code keeps (its
 * stores dict, the reserve's slot list, this step's HITs), and answers None for anything else:
 * the caller then takes its Python path, which decides every case (and is the twin:
 * kvd_proto/native.py's PyLookups.store / pin, run by the tests with KVD_NATIVE=0).
 *
 *   store(keys, positions, req_id, slots, shared, per_record, room)
 *       The keys neither stored by this engine nor in the index are new: take as many slots
 *       from the end of `slots`, record each as the engine's store (stores[key] = (offset,
 *       shared)) and encode the STORE record. -> (new, offsets, record or None when nothing
 *       is new), or None: lookups not enabled (no index, a reset on its way), no key, more
 *       keys than one record carries (`per_record`), a key named twice, a key not bytes, more
 *       new keys than `room` (the tracker's bound) or than `slots` holds (the reserve is
 *       short: the Python path declines and counts it).
 *   pin(keys, positions, req_id, per_record)
 *       Every key a HIT of this step: (offsets, frozenset(keys), the PIN record), or None
 *       (a key no HIT, named twice, or more than one record carries).
 *
 * `positions` is used when it has one entry per key (else the record carries none), as the
 * Python path does. Nothing is changed before the record is encoded: an error leaves the
 * containers as they were.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_lookups.h"
#include "_records.h"

#define KIND_STORE 1           /* kvd_proto/records.py STORE */
#define KIND_COMPLETE_STORE 2  /* kvd_proto/records.py COMPLETE_STORE */
#define KIND_PIN 3             /* kvd_proto/records.py PIN */

const char LOOKUPS_STORE_DOC[] =
    "store(keys, positions, req_id, slots, shared, per_record, room) -> (new, offsets, record "
    "or None) or None: a store call's common case (kvd_proto/_steps.c)";
const char LOOKUPS_COMPLETE_DOC[] =
    "complete(keys, completed, req_id, per_record) -> ((seq, keys, stores), record) or None: "
    "a successful completion's common case (kvd_proto/_steps.c)";
const char LOOKUPS_SETTLE_DOC[] =
    "settle(entries, completed) -> None: forget the completed stores the daemon has read "
    "(kvd_proto/_steps.c)";
const char LOOKUPS_PIN_DOC[] =
    "pin(keys, positions, req_id, per_record) -> (offsets, frozenset(keys), record) or None: a "
    "load call's common case (kvd_proto/_steps.c)";

/* `positions` when it has one entry per key (a new reference), else None. */
static PyObject *positions_for(PyObject *positions, Py_ssize_t n) {
    if (positions == Py_None) return Py_NewRef(Py_None);
    Py_ssize_t len = PyObject_Length(positions);
    if (len < 0) return NULL;
    return Py_NewRef(len == n && n > 0 ? positions : Py_None);
}

static PyObject *encode(int kind, PyObject *req_id, PyObject *keys, PyObject *positions,
                        PyObject *index, PyObject *offsets) {
    PyObject *kind_obj = PyLong_FromLong(kind);
    if (kind_obj == NULL) return NULL;
    PyObject *prefix = PyBytes_FromStringAndSize(NULL, 0);
    if (prefix == NULL) {
        Py_DECREF(kind_obj);
        return NULL;
    }
    PyObject *args[8] = {kind_obj, prefix, req_id, keys, Py_True, positions, index, offsets};
    PyObject *record = native_keys_record(NULL, args, 8);
    Py_DECREF(kind_obj);
    Py_DECREF(prefix);
    return record;
}

static int parse_size(PyObject *obj, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(obj);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

PyObject *Lookups_store(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "store(keys, positions, req_id, slots, shared, per_record, room)");
        return NULL;
    }
    PyObject *keys = args[0], *req_id = args[2], *slots = args[3], *shared = args[4];
    Py_ssize_t per_record, room;
    if (parse_size(args[5], &per_record) < 0 || parse_size(args[6], &room) < 0) return NULL;
    if (!PyList_CheckExact(slots)) {
        PyErr_SetString(PyExc_TypeError, "slots must be a list");
        return NULL;
    }
    if (!self->enabled || !self->g.bound) Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL, *seen = NULL, *index = NULL, *new = NULL, *taken = NULL;
    PyObject *positions = NULL, *record = NULL;
    uint64_t *home = NULL;
    if (n == 0 || n > per_record) goto fallback;
    seen = PySet_New(NULL);
    index = PyList_New(0);
    home = PyMem_Malloc((size_t)n * sizeof *home);
    if (seen == NULL || index == NULL || home == NULL) {
        if (home == NULL) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {        /* every bucket's line asked for at once */
        if (!PyBytes_CheckExact(items[i])) goto fallback;
        home[i] = lookups_prefetch(self, items[i]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        if (PySet_Add(seen, key) < 0) goto done;
        int own = PyDict_Contains(self->stores, key);
        if (own < 0) goto done;
        uint64_t word;
        if (own || lookups_probe_at(self, home[i], key, &word) >= 0) continue;
        PyObject *at = PyLong_FromSsize_t(i);
        if (at == NULL) goto done;
        int rc = PyList_Append(index, at);
        Py_DECREF(at);
        if (rc < 0) goto done;
    }
    Py_ssize_t m = PyList_GET_SIZE(index), held = PyList_GET_SIZE(slots);
    if (PySet_GET_SIZE(seen) != n || m > room || m > held) goto fallback;
    new = PyList_New(m);
    if (new == NULL) goto done;
    for (Py_ssize_t j = 0; j < m; j++)
        PyList_SET_ITEM(new, j, Py_NewRef(items[PyLong_AsSsize_t(PyList_GET_ITEM(index, j))]));
    taken = PyList_GetSlice(slots, held - m, held);
    if (taken == NULL) goto done;
    if (m == 0) {
        result = PyTuple_Pack(3, new, taken, Py_None);
        goto done;
    }
    positions = positions_for(args[1], n);
    if (positions == NULL) goto done;
    record = encode(KIND_STORE, req_id, seq, positions, index, taken);
    if (record == NULL) goto done;
    /* The record is made: from here on the containers change. */
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *store = PyTuple_Pack(2, PyList_GET_ITEM(taken, j), shared);
        if (store == NULL) goto done;
        int rc = PyDict_SetItem(self->stores, PyList_GET_ITEM(new, j), store);
        Py_DECREF(store);
        if (rc < 0) goto done;
    }
    if (PyList_SetSlice(slots, held - m, held, NULL) < 0) goto done;
    result = PyTuple_Pack(3, new, taken, record);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(seen);
    Py_XDECREF(index);
    Py_XDECREF(new);
    Py_XDECREF(taken);
    Py_XDECREF(positions);
    Py_XDECREF(record);
    PyMem_Free(home);
    Py_DECREF(seq);
    return result;
}

PyObject *Lookups_pin(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "pin(keys, positions, req_id, per_record)");
        return NULL;
    }
    PyObject *keys = args[0], *req_id = args[2];
    Py_ssize_t per_record;
    if (parse_size(args[3], &per_record) < 0) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL, *offsets = NULL, *keyset = NULL, *positions = NULL;
    PyObject *record = NULL;
    if (n == 0 || n > per_record) goto fallback;
    offsets = PyList_New(n);
    if (offsets == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *offset = PyDict_GetItemWithError(self->hits, items[i]);
        if (offset == NULL) {
            if (PyErr_Occurred()) goto done;
            goto fallback;
        }
        PyList_SET_ITEM(offsets, i, Py_NewRef(offset));
    }
    keyset = PyFrozenSet_New(seq);
    if (keyset == NULL) goto done;
    if (PySet_GET_SIZE(keyset) != n) goto fallback;
    positions = positions_for(args[1], n);
    if (positions == NULL) goto done;
    record = encode(KIND_PIN, req_id, seq, positions, Py_None, offsets);
    if (record == NULL) goto done;
    result = PyTuple_Pack(3, offsets, keyset, record);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(offsets);
    Py_XDECREF(keyset);
    Py_XDECREF(positions);
    Py_XDECREF(record);
    Py_DECREF(seq);
    return result;
}

/* complete(keys, completed, req_id, per_record) -> ((seq, keys, stores), record) or None
 *
 * Stores of `keys` finished, the common case: every key a store in flight of this engine
 * (stores[key]), all sharing one record (`shared`: made in one step, of a known reset epoch),
 * distinct, no more than one record carries. Each key goes into `completed` (its lookups answer
 * HIT from now on); the answer is the entry the session keeps until the daemon has read the
 * completion (the step its stores were told in, the keys, their stores) and the COMPLETE_STORE
 * record (successful) to send. None: anything else (the Python path decides it). */
PyObject *Lookups_complete(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "complete(keys, completed, req_id, per_record)");
        return NULL;
    }
    PyObject *completed = args[1], *req_id = args[2];
    Py_ssize_t per_record;
    if (parse_size(args[3], &per_record) < 0) return NULL;
    if (!PySet_Check(completed)) {
        PyErr_SetString(PyExc_TypeError, "completed must be a set");
        return NULL;
    }
    int distinct = PyAnySet_Check(args[0]);       /* vLLM passes its job's keys as a set */
    PyObject *keys = PySequence_Tuple(args[0]);
    if (keys == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    PyObject *result = NULL, *got = NULL, *seen = NULL, *epoch_obj = NULL, *seq_obj = NULL;
    PyObject *prefix = NULL, *kind = NULL, *record = NULL, *shared = NULL;
    if (n == 0 || n > per_record) goto fallback;
    got = PyTuple_New(n);
    seen = distinct ? NULL : PySet_New(NULL);
    if (got == NULL || (!distinct && seen == NULL)) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        PyObject *store = PyDict_GetItemWithError(self->stores, key);
        if (store == NULL) {
            if (PyErr_Occurred()) goto done;
            goto fallback;
        }
        if (!PyTuple_CheckExact(store) || PyTuple_GET_SIZE(store) != 2) goto fallback;
        if (shared == NULL) shared = PyTuple_GET_ITEM(store, 1);
        else if (PyTuple_GET_ITEM(store, 1) != shared) goto fallback;
        PyTuple_SET_ITEM(got, i, Py_NewRef(store));
        if (seen != NULL && PySet_Add(seen, key) < 0) goto done;
    }
    if (seen != NULL && PySet_GET_SIZE(seen) != n) goto fallback;
    epoch_obj = PyObject_GetAttrString(shared, "reset_epoch");
    seq_obj = PyObject_GetAttrString(shared, "seq");
    if (epoch_obj == NULL || seq_obj == NULL) goto done;
    long long epoch = PyLong_AsLongLong(epoch_obj);
    if (epoch == -1 && PyErr_Occurred()) goto done;
    if (epoch < 0) goto fallback;                  /* a reset's answer still on its way */
    unsigned char head[9];
    uint64_t epoch64 = (uint64_t)epoch;
    memcpy(head, &epoch64, 8);
    head[8] = 1;                                   /* success */
    prefix = PyBytes_FromStringAndSize((char *)head, 9);
    kind = PyLong_FromLong(KIND_COMPLETE_STORE);
    if (prefix == NULL || kind == NULL) goto done;
    PyObject *rargs[8] = {kind, prefix, req_id, keys, Py_False, Py_None, Py_None, Py_None};
    record = native_keys_record(NULL, rargs, 8);
    if (record == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++)            /* lookups answer HIT from now on */
        if (PySet_Add(completed, PyTuple_GET_ITEM(keys, i)) < 0) goto done;
    result = Py_BuildValue("((OOO)O)", seq_obj, keys, got, record);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(got);
    Py_XDECREF(seen);
    Py_XDECREF(epoch_obj);
    Py_XDECREF(seq_obj);
    Py_XDECREF(prefix);
    Py_XDECREF(kind);
    Py_XDECREF(record);
    Py_DECREF(keys);
    return result;
}

/* settle(entries, completed) -> None
 *
 * Completed stores the daemon has read: for each (seq, keys, stores) entry, every key whose
 * store in flight is still that one is forgotten (stores and `completed`): the index answers
 * for it from now on. A key stored again since (a newer store) is left alone. */
PyObject *Lookups_settle(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PySet_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "settle(entries, completed: set)");
        return NULL;
    }
    PyObject *completed = args[1];
    PyObject *entries = PySequence_Fast(args[0], "entries must be a sequence");
    if (entries == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(entries);
    for (Py_ssize_t e = 0; e < count; e++) {
        PyObject *entry = PySequence_Fast_GET_ITEM(entries, e);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3 ||
            !PyTuple_Check(PyTuple_GET_ITEM(entry, 1)) || !PyTuple_Check(PyTuple_GET_ITEM(entry, 2)) ||
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(entry, 1)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(entry, 2))) {
            Py_DECREF(entries);
            PyErr_SetString(PyExc_TypeError, "an entry is (seq, keys, stores), one store per key");
            return NULL;
        }
        PyObject *keys = PyTuple_GET_ITEM(entry, 1), *got = PyTuple_GET_ITEM(entry, 2);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(keys); i++) {
            PyObject *key = PyTuple_GET_ITEM(keys, i);
            PyObject *store = PyDict_GetItemWithError(self->stores, key);
            if (store == NULL && PyErr_Occurred()) goto fail;
            if (store != PyTuple_GET_ITEM(got, i)) continue;
            if (PyDict_DelItem(self->stores, key) < 0 || PySet_Discard(completed, key) < 0)
                goto fail;
        }
    }
    Py_DECREF(entries);
    Py_RETURN_NONE;
fail:
    Py_DECREF(entries);
    return NULL;
}

/* key_positions(position, keys) -> range, list or None
 *
 * The token positions of `keys` (`position(key)`: vLLM's ReqContext.get_offload_key_position)
 * for the daemon's eviction order. The keys of one call are almost always consecutive chunks:
 * when the first, middle and last positions say so, a range (three calls); otherwise every
 * key's position. None when a key has none. */
static PyObject *call_position(PyObject *position, PyObject *key, long long *out) {
    PyObject *value = PyObject_CallOneArg(position, key);
    if (value == NULL || value == Py_None) return value;
    *out = PyLong_AsLongLong(value);
    if (*out == -1 && PyErr_Occurred()) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

PyObject *native_key_positions(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "key_positions(position, keys)");
        return NULL;
    }
    PyObject *position = args[0];
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = NULL;
    if (n >= 3) {
        long long v[3];
        Py_ssize_t at[3] = {0, n / 2, n - 1};
        int whole = 1;
        for (int i = 0; i < 3 && whole; i++) {
            PyObject *value = call_position(position, items[at[i]], &v[i]);
            if (value == NULL) goto done;
            whole = value != Py_None;
            Py_DECREF(value);
        }
        if (whole) {
            long long span = v[2] - v[0], step = span / (n - 1);
            if (step > 0 && span % (n - 1) == 0 && v[1] == v[0] + step * (n / 2)) {
                out = PyObject_CallFunction((PyObject *)&PyRange_Type, "LLL", v[0], v[2] + 1,
                                            step);
                goto done;
            }
        }
    }
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long unused;
        PyObject *value = call_position(position, items[i], &unused);
        if (value == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        if (value == Py_None) {
            Py_DECREF(value);
            Py_SETREF(out, Py_NewRef(Py_None));
            goto done;
        }
        PyList_SET_ITEM(out, i, value);
    }
done:
    Py_DECREF(seq);
    return out;
}
