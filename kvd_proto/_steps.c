/* kvd_proto._native, part three: the scheduler's store and load calls, compiled.
 *
 * vLLM's scheduler calls prepare_store and prepare_load a few times a step, between long
 * stretches of its own Python, so every object a call touches is cold: in Python the session's
 * store of 16 keys walked ~25 functions (the index probe, the reserve, the tracker, the record)
 * and cost 15-25 us. Each method here does a call's common case in one pass over the keys,
 * with the same effects on the same Python containers the session's Python code keeps (its
 * stores dict, the reserve's slot list; this step's HITs are the Lookups' own), and answers
 * None for anything else: the caller then takes its Python path, which decides every case. That
 * path is these methods' one Python twin (kvd_client/offload/transfers.py, stores.py, loads.py:
 * on the common case it answers, changes the containers and writes the records exactly as they
 * do; tests/unit/test_steps_differential.py drives both through random sequences).
 *
 * The containers are read by position; their shapes are named in kvd_proto/native.py:
 *   Store       a stores dict value: (offset, shared[, call]), an exact tuple
 *   StoreCall   call: (the COMPLETE_STORE record of the call's whole success, its key count)
 *   StepShared  shared: the object whose attributes `reset_epoch` and `seq` are read by name
 *   SettleEntry (seq, keys, stores[, hashes]): what `complete` answers and `settle` reads
 *
 *   store(keys, positions, req_id, slots, shared, per_record, room)
 *       The keys neither stored by this engine nor in the index are new: take as many slots
 *       from the end of `slots`, record each as the engine's store (stores[key] = (offset,
 *       shared, call), or (offset, shared) while `shared.reset_epoch` is not known) and encode
 *       the STORE record. -> (new, offsets, record or None when nothing is new), or None:
 *       lookups not enabled (no index, a reset on its way), no key, more keys than one record
 *       carries (`per_record`), a key named twice, a key not bytes, more new keys than `room`
 *       (the tracker's bound) or than `slots` holds (the reserve is short: the Python path
 *       declines and counts it).
 *   pin(keys, positions, req_id, per_record, epoch)
 *       Every key a HIT of this step: (offsets, frozenset(keys), the PIN record, the
 *       COMPLETE_LOAD record of reset epoch `epoch` its whole completion will send), or None
 *       (a key no HIT, named twice, or more than one record carries).
 *
 * `positions` is used when it has one entry per key (else the record carries none), as the
 * Python path does. Nothing is changed before the record is encoded: an error leaves the
 * containers as they were. The record kinds are _records.h's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_lookups.h"
#include "_records.h"

const char LOOKUPS_STORE_DOC[] =
    "store(keys, positions, req_id, slots, shared, per_record, room) -> (new, offsets, record "
    "or None) or None: a store call's common case (kvd_proto/_steps.c)";
const char LOOKUPS_COMPLETE_DOC[] =
    "complete(keys, completed, req_id, per_record) -> ((seq, keys, stores, hashes), record) "
    "or None: a successful completion's common case (kvd_proto/_steps.c)";
const char LOOKUPS_SETTLE_DOC[] =
    "settle(entries, completed) -> None: forget the completed stores the daemon has read "
    "(kvd_proto/_steps.c)";
const char LOOKUPS_PIN_DOC[] =
    "pin(keys, positions, req_id, per_record, epoch) -> (offsets, frozenset(keys), record, "
    "completion) or None: a load call's common case (kvd_proto/_steps.c)";

/* `positions` when it has one entry per key (a new reference), else None. */
static PyObject *positions_for(PyObject *positions, Py_ssize_t n) {
    if (positions == Py_None) return Py_NewRef(Py_None);
    Py_ssize_t len = PyObject_Length(positions);
    if (len < 0) return NULL;
    return Py_NewRef(len == n && n > 0 ? positions : Py_None);
}

/* One record of `kind` through the shared encoder (kvd_proto/_records.c), its prefix the
 * `head_len` bytes at `head`. */
static PyObject *encode_record(int kind, const void *head, Py_ssize_t head_len, PyObject *req_id,
                               PyObject *keys, int with_positions, PyObject *positions,
                               PyObject *index, PyObject *offsets) {
    PyObject *kind_obj = PyLong_FromLong(kind);
    PyObject *prefix = PyBytes_FromStringAndSize((const char *)head, head_len);
    PyObject *record = NULL;
    if (kind_obj != NULL && prefix != NULL) {
        PyObject *args[8] = {kind_obj, prefix, req_id, keys, with_positions ? Py_True : Py_False,
                             positions, index, offsets};
        record = native_keys_record(NULL, args, 8);
    }
    Py_XDECREF(kind_obj);
    Py_XDECREF(prefix);
    return record;
}

static PyObject *encode(int kind, PyObject *req_id, PyObject *keys, PyObject *positions,
                        PyObject *index, PyObject *offsets) {
    return encode_record(kind, "", 0, req_id, keys, 1, positions, index, offsets);
}

/* A completion record: COMPLETE_STORE (u64 reset epoch, u8 success: always 1 here) or
 * COMPLETE_LOAD (u64 reset epoch), with the keys and no columns. */
static PyObject *encode_completion(int kind, uint64_t epoch, PyObject *req_id, PyObject *keys) {
    unsigned char head[9];
    memcpy(head, &epoch, 8);
    head[8] = 1;                                   /* success */
    return encode_record(kind, head, kind == KIND_COMPLETE_STORE ? 9 : 8, req_id, keys, 0,
                         Py_None, Py_None, Py_None);
}

/* Ask for every key object's line (and the next: a key's bytes may cross into it) before the
 * keys are read: vLLM's keys are cold by the time a call names them, and reading them one
 * after the other costs one miss each in turn; asked for together, the misses overlap. */
static inline void prefetch_keys(PyObject *const *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        __builtin_prefetch(items[i]);
        __builtin_prefetch((const char *)items[i] + 64);
    }
}

static int parse_size(PyObject *obj, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(obj);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The StoreCall (COMPLETE_STORE record, key count) of one call's stores, made while their keys
 * are in the cache: what their whole successful completion sends (`complete`). None where the
 * stores' reset epoch is not known yet (`shared.reset_epoch` < 0, or no such attribute). */
static PyObject *completion_of(PyObject *shared, PyObject *req_id, PyObject *new) {
    PyObject *epoch_obj = PyObject_GetAttrString(shared, "reset_epoch");
    long long epoch = -1;
    if (epoch_obj != NULL) {
        epoch = PyLong_Check(epoch_obj) ? PyLong_AsLongLong(epoch_obj) : -1;
        Py_DECREF(epoch_obj);
    }
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError) &&
            !PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear();
        epoch = -1;
    }
    if (epoch < 0) return Py_NewRef(Py_None);
    PyObject *record = encode_completion(KIND_COMPLETE_STORE, (uint64_t)epoch, req_id, new);
    return record == NULL ? NULL : Py_BuildValue("(Nn)", record, PyList_GET_SIZE(new));
}

/* Whether the n keys are distinct: 1, 0 (two are equal), -1 an error. By their
 * hashes in a small open-addressing table (a set of them cost ~3 us a call): keys whose
 * hashes all differ are distinct; two equal hashes are compared as keys. */
static int keys_distinct(PyObject *const *items, Py_ssize_t n) {
    if (n < 2) return 1;
    size_t size = 16;
    while (size < 2 * (size_t)n) size <<= 1;
    Py_ssize_t *table = PyMem_Malloc(size * sizeof *table);
    Py_hash_t *hashes = PyMem_Malloc((size_t)n * sizeof *hashes);
    int result = 1;
    if (table == NULL || hashes == NULL) {
        PyErr_NoMemory();
        result = -1;
        goto out;
    }
    memset(table, -1, size * sizeof *table);
    for (Py_ssize_t i = 0; i < n && result == 1; i++) {
        Py_hash_t h = PyObject_Hash(items[i]);
        if (h == -1) {
            result = -1;
            break;
        }
        hashes[i] = h;
        size_t b = (size_t)h & (size - 1);
        while (table[b] >= 0) {
            Py_ssize_t j = table[b];
            if (hashes[j] == h) {
                int eq = PyObject_RichCompareBool(items[i], items[j], Py_EQ);
                if (eq != 0) {
                    result = eq < 0 ? -1 : 0;
                    break;
                }
            }
            b = (b + 1) & (size - 1);
        }
        table[b] = i;
    }
out:
    PyMem_Free(table);
    PyMem_Free(hashes);
    return result;
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
    PyObject *result = NULL, *index = NULL, *new = NULL, *taken = NULL;
    PyObject *positions = NULL, *record = NULL, *call = NULL;
    uint64_t *home = NULL;
    if (n == 0 || n > per_record) goto fallback;
    index = PyList_New(0);
    home = PyMem_Malloc((size_t)n * sizeof *home);
    if (index == NULL || home == NULL) {
        if (home == NULL) PyErr_NoMemory();
        goto done;
    }
    prefetch_keys(items, n);
    for (Py_ssize_t i = 0; i < n; i++) {        /* every bucket's line asked for at once */
        if (!PyBytes_CheckExact(items[i])) goto fallback;
        home[i] = lookups_prefetch(self, items[i]);
    }
    int distinct = keys_distinct(items, n);
    if (distinct < 0) goto done;
    if (!distinct) goto fallback;
    for (Py_ssize_t i = 0; i < n; i++)          /* and the slots those buckets name */
        lookups_prefetch_slots(self, home[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
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
    if (m > room || m > held) goto fallback;
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
    call = completion_of(shared, req_id, new);
    if (call == NULL) goto done;
    /* The records are made: from here on the containers change. */
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *store = call == Py_None ? PyTuple_Pack(2, PyList_GET_ITEM(taken, j), shared)
                                          : PyTuple_Pack(3, PyList_GET_ITEM(taken, j), shared, call);
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
    Py_XDECREF(index);
    Py_XDECREF(new);
    Py_XDECREF(taken);
    Py_XDECREF(positions);
    Py_XDECREF(record);
    Py_XDECREF(call);
    PyMem_Free(home);
    Py_DECREF(seq);
    return result;
}

PyObject *Lookups_pin(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "pin(keys, positions, req_id, per_record, epoch)");
        return NULL;
    }
    unsigned long long epoch = PyLong_AsUnsignedLongLong(args[4]);
    if (epoch == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *keys = args[0], *req_id = args[2];
    Py_ssize_t per_record;
    if (parse_size(args[3], &per_record) < 0) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL, *offsets = NULL, *keyset = NULL, *positions = NULL;
    PyObject *record = NULL, *done_record = NULL;
    if (n == 0 || n > per_record) goto fallback;
    offsets = PyList_New(n);
    if (offsets == NULL) goto done;
    prefetch_keys(items, n);             /* the key set reads their hashes */
    Py_ssize_t hint = self->pin_cursor;   /* where the last pin ended: this one follows */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t off;
        int found = lookups_hit_find(self, items[i], &hint, &off);
        if (found < 0) goto done;
        if (!found) goto fallback;
        PyObject *offset = PyLong_FromUnsignedLongLong(off);
        if (offset == NULL) goto done;
        PyList_SET_ITEM(offsets, i, offset);
    }
    keyset = PyFrozenSet_New(seq);
    if (keyset == NULL) goto done;
    if (PySet_GET_SIZE(keyset) != n) goto fallback;
    positions = positions_for(args[1], n);
    if (positions == NULL) goto done;
    record = encode(KIND_PIN, req_id, seq, positions, Py_None, offsets);
    if (record == NULL) goto done;
    /* The completion the whole pin will need, made while the keys are in the cache (at
     * finish_loads they are cold again, and its keys come as vLLM's set). */
    done_record = encode_completion(KIND_COMPLETE_LOAD, epoch, req_id, seq);
    if (done_record == NULL) goto done;
    result = PyTuple_Pack(4, offsets, keyset, record, done_record);
    if (result != NULL && hint >= 0) self->pin_cursor = hint;
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(offsets);
    Py_XDECREF(keyset);
    Py_XDECREF(positions);
    Py_XDECREF(record);
    Py_XDECREF(done_record);
    Py_DECREF(seq);
    return result;
}

/* A key's hash as its set entry holds it, used as it is: on CPython 3.11 the dict and set
 * calls below take it, so a completion of vLLM's key set reads no key object (they are cold
 * by then: one miss each). Elsewhere the public calls hash the key again (same results). */
#if PY_VERSION_HEX < 0x030C0000
#define KNOWN_HASH 1
#endif

static inline PyObject *dict_get(PyObject *d, PyObject *k, Py_hash_t h) {
#ifdef KNOWN_HASH
    return _PyDict_GetItem_KnownHash(d, k, h);
#else
    (void)h;
    return PyDict_GetItemWithError(d, k);
#endif
}

static inline int dict_set(PyObject *d, PyObject *k, PyObject *v, Py_hash_t h) {
#ifdef KNOWN_HASH
    return _PyDict_SetItem_KnownHash(d, k, v, h);
#else
    (void)h;
    return PyDict_SetItem(d, k, v);
#endif
}

/* Delete k from d if it is there. */
static inline int dict_discard(PyObject *d, PyObject *k, Py_hash_t h) {
#ifdef KNOWN_HASH
    int has = _PyDict_Contains_KnownHash(d, k, h);
    return has <= 0 ? has : _PyDict_DelItem_KnownHash(d, k, h);
#else
    (void)h;
    int has = PyDict_Contains(d, k);
    return has <= 0 ? has : PyDict_DelItem(d, k);
#endif
}

/* The keys of `obj` as a tuple, their hashes into *hashes (PyMem_Malloc'd): read from a
 * set's entries where KNOWN_HASH, else computed. */
static PyObject *keys_and_hashes(PyObject *obj, Py_hash_t **hashes) {
    *hashes = NULL;
    PyObject *keys;
#ifdef KNOWN_HASH
    if (PyAnySet_Check(obj)) {
        Py_ssize_t n = PySet_GET_SIZE(obj), pos = 0, i = 0;
        keys = PyTuple_New(n);
        *hashes = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_hash_t));
        if (keys == NULL || *hashes == NULL) goto nomem;
        PyObject *key;
        Py_hash_t hash;
        while (i < n && _PySet_NextEntry(obj, &pos, &key, &hash)) {
            PyTuple_SET_ITEM(keys, i, Py_NewRef(key));
            (*hashes)[i++] = hash;
        }
        if (i != n) {                       /* the set changed under us: not ours to trust */
            PyErr_SetString(PyExc_RuntimeError, "the key set changed during the call");
            goto fail;
        }
        return keys;
    }
#endif
    keys = PySequence_Tuple(obj);
    if (keys == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    *hashes = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_hash_t));
    if (*hashes == NULL) goto nomem;
    prefetch_keys(&PyTuple_GET_ITEM(keys, 0), n);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_hash_t hash = PyObject_Hash(PyTuple_GET_ITEM(keys, i));
        if (hash == -1) goto fail;
        (*hashes)[i] = hash;
    }
    return keys;
nomem:
    PyErr_NoMemory();
fail:
    Py_XDECREF(keys);
    PyMem_Free(*hashes);
    *hashes = NULL;
    return NULL;
}

/* complete(keys, completed, req_id, per_record) -> ((seq, keys, stores, hashes), record) or None
 *
 * Stores of `keys` finished, the common case: every key a store in flight of this engine
 * (stores[key], a Store), all sharing one StepShared (made in one step, of a known reset
 * epoch), distinct, no more than one record carries. Each key goes into `completed` (a dict:
 * key -> None; its lookups answer HIT from now on); the answer is the SettleEntry the session
 * keeps until the daemon has read the completion (the step its stores were told in, the keys,
 * their stores, the keys' hashes as bytes) and the COMPLETE_STORE record (successful) to send:
 * the StoreCall's record when the keys are exactly that call's, else encoded here. None:
 * anything else (the Python path decides it). */
PyObject *Lookups_complete(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "complete(keys, completed, req_id, per_record)");
        return NULL;
    }
    PyObject *completed = args[1], *req_id = args[2];
    Py_ssize_t per_record;
    if (parse_size(args[3], &per_record) < 0) return NULL;
    if (!PyDict_Check(completed)) {
        PyErr_SetString(PyExc_TypeError, "completed must be a dict");
        return NULL;
    }
    int distinct = PyAnySet_Check(args[0]);       /* vLLM passes its job's keys as a set */
    Py_hash_t *hashes;
    PyObject *keys = keys_and_hashes(args[0], &hashes);
    if (keys == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    PyObject *result = NULL, *got = NULL, *epoch_obj = NULL, *seq_obj = NULL;
    PyObject *record = NULL, *shared = NULL, *call = NULL;
    PyObject *hash_bytes = NULL;
    if (n == 0 || n > per_record) goto fallback;
    if (!distinct) {
        distinct = keys_distinct(&PyTuple_GET_ITEM(keys, 0), n);
        if (distinct < 0) goto done;
        if (!distinct) goto fallback;
    }
    got = PyTuple_New(n);
    if (got == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        PyObject *store = dict_get(self->stores, key, hashes[i]);
        if (store == NULL) {
            if (PyErr_Occurred()) goto done;
            goto fallback;
        }
        if (!PyTuple_CheckExact(store) || PyTuple_GET_SIZE(store) < 2) goto fallback;
        PyObject *its_call = PyTuple_GET_SIZE(store) > 2 ? PyTuple_GET_ITEM(store, 2) : Py_None;
        if (shared == NULL) {
            shared = PyTuple_GET_ITEM(store, 1);
            call = its_call;
        } else if (PyTuple_GET_ITEM(store, 1) != shared) {
            goto fallback;
        } else if (its_call != call) {
            call = Py_None;                        /* keys of several calls: encoded here */
        }
        PyTuple_SET_ITEM(got, i, Py_NewRef(store));
    }
    epoch_obj = PyObject_GetAttrString(shared, "reset_epoch");
    seq_obj = PyObject_GetAttrString(shared, "seq");
    if (epoch_obj == NULL || seq_obj == NULL) goto done;
    long long epoch = PyLong_AsLongLong(epoch_obj);
    if (epoch == -1 && PyErr_Occurred()) goto done;
    if (epoch < 0) goto fallback;                  /* a reset's answer still on its way */
    if (PyTuple_CheckExact(call) && PyTuple_GET_SIZE(call) == 2 &&
        PyLong_AsSsize_t(PyTuple_GET_ITEM(call, 1)) == n) {
        record = Py_NewRef(PyTuple_GET_ITEM(call, 0));   /* made by `store`: the same bytes */
    } else {
        if (PyErr_Occurred()) goto done;
        record = encode_completion(KIND_COMPLETE_STORE, (uint64_t)epoch, req_id, keys);
        if (record == NULL) goto done;
    }
    hash_bytes = PyBytes_FromStringAndSize((const char *)hashes, n * (Py_ssize_t)sizeof(Py_hash_t));
    if (hash_bytes == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++)            /* lookups answer HIT from now on */
        if (dict_set(completed, PyTuple_GET_ITEM(keys, i), Py_None, hashes[i]) < 0) goto done;
    result = Py_BuildValue("((OOOO)O)", seq_obj, keys, got, hash_bytes, record);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(got);
    Py_XDECREF(epoch_obj);
    Py_XDECREF(seq_obj);
    Py_XDECREF(record);
    Py_XDECREF(hash_bytes);
    PyMem_Free(hashes);
    Py_DECREF(keys);
    return result;
}

/* settle(entries, completed) -> None
 *
 * Completed stores the daemon has read: for each SettleEntry (seq, keys, stores[, hashes]),
 * every key whose store in flight is still that one (the same tuple) is forgotten (stores and
 * `completed`): the index answers for it from now on. A key stored again since (a newer store)
 * is left alone. `hashes` (what `complete` kept) spares reading the keys again. Its Python twin
 * is kvd_client/offload/stores.py's forgetting (`StoreTracker._forget`). */
PyObject *Lookups_settle(Lookups *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "settle(entries, completed: dict)");
        return NULL;
    }
    PyObject *completed = args[1];
    PyObject *entries = PySequence_Fast(args[0], "entries must be a sequence");
    if (entries == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(entries);
    for (Py_ssize_t e = 0; e < count; e++) {
        PyObject *entry = PySequence_Fast_GET_ITEM(entries, e);
        Py_ssize_t size = PyTuple_Check(entry) ? PyTuple_GET_SIZE(entry) : 0;
        PyObject *keys = size >= 3 ? PyTuple_GET_ITEM(entry, 1) : NULL;
        PyObject *got = size >= 3 ? PyTuple_GET_ITEM(entry, 2) : NULL;
        PyObject *hashes = size == 4 ? PyTuple_GET_ITEM(entry, 3) : NULL;
        if ((size != 3 && size != 4) || !PyTuple_Check(keys) || !PyTuple_Check(got) ||
            PyTuple_GET_SIZE(keys) != PyTuple_GET_SIZE(got) ||
            (hashes != NULL && (!PyBytes_Check(hashes) || PyBytes_GET_SIZE(hashes) !=
                                PyTuple_GET_SIZE(keys) * (Py_ssize_t)sizeof(Py_hash_t)))) {
            Py_DECREF(entries);
            PyErr_SetString(PyExc_TypeError, "an entry is (seq, keys, stores[, hashes]), one "
                            "store per key");
            return NULL;
        }
        const char *hash_at = hashes != NULL ? PyBytes_AS_STRING(hashes) : NULL;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(keys); i++) {
            PyObject *key = PyTuple_GET_ITEM(keys, i);
            Py_hash_t hash;
            if (hash_at != NULL) {
                memcpy(&hash, hash_at + i * (Py_ssize_t)sizeof hash, sizeof hash);
            } else if ((hash = PyObject_Hash(key)) == -1) {
                goto fail;
            }
            PyObject *store = dict_get(self->stores, key, hash);
            if (store == NULL && PyErr_Occurred()) goto fail;
            if (store != PyTuple_GET_ITEM(got, i)) continue;
#ifdef KNOWN_HASH
            if (_PyDict_DelItem_KnownHash(self->stores, key, hash) < 0) goto fail;
#else
            if (PyDict_DelItem(self->stores, key) < 0) goto fail;
#endif
            if (dict_discard(completed, key, hash) < 0) goto fail;
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
 * The token positions of `keys` (`position(key)`: vLLM's ReqContext.get_offload_key_position,
 * or the dict it reads, looked up directly: no Python call per key) for the daemon's eviction
 * order. The keys of one call are almost always consecutive chunks: when the first, middle and
 * last positions say so, a range (three reads); otherwise every key's position. None when a
 * key has none. */
static PyObject *call_position(PyObject *position, PyObject *key, long long *out) {
    PyObject *value;
    if (PyDict_CheckExact(position)) {
        value = PyDict_GetItemWithError(position, key);
        if (value == NULL) {
            if (PyErr_Occurred()) return NULL;
            value = Py_None;
        }
        Py_INCREF(value);
    } else {
        value = PyObject_CallOneArg(position, key);
    }
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

/* same_set(a, b) -> bool: True only when a and b are sets (or frozensets) whose hash tables hold
 * the very same objects in every entry: the same set, found by one sequential pass over both
 * tables instead of a probe of one set per element of the other (each a cold line: a 64-key
 * pin's completion spent ~5 us in issuperset). Two sets built by adding the same objects in
 * the same order have equal tables, as vLLM's job keys (set(keys_to_load)) and the pin's
 * frozenset of the same list do. False says nothing: the caller compares them as usual. */
PyObject *native_same_set(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "same_set(a, b)");
        return NULL;
    }
    if (!PyAnySet_CheckExact(args[0]) || !PyAnySet_CheckExact(args[1])) Py_RETURN_FALSE;
    PySetObject *a = (PySetObject *)args[0], *b = (PySetObject *)args[1];
    if (a == b) Py_RETURN_TRUE;
    if (a->mask != b->mask || a->used != b->used || a->fill != b->fill) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i <= a->mask; i++)
        if (a->table[i].key != b->table[i].key) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}
