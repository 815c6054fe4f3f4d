/* kvd_proto._native, part five: a session's reserve topped up (GRANTED), and the evicted
 * blocks its granted slots still hold, in one table with no Python object per key.
 *
 * The daemon tops an engine's reserve up unasked, a few hundred slots a step when the engine
 * stores flat out, and (RESERVE flag 2) names the evicted block each slot still holds, so the
 * engine keeps hitting it until it stores into the slot (docs/attach.md, "Kept blocks in
 * granted slots"). Kept in two dicts (key -> offset and offset -> key, a bytes object per key,
 * rebuilt now and then to forget the slots stored into) that was ~60-90 us of the scheduler
 * thread a step at 3,000 sessions and 128 sequences; here a GRANTED is one pass and a slot
 * leaving the reserve one probe:
 *
 *   KeptTable()            key -> value: the offset of the granted slot holding the evicted
 *                          block `key` (>= 0), or -(seq + 1) while the engine takes it back
 *                          (RESTORE sent in step `seq`). An offset is in at most one entry.
 *     .apply(payload, slots) -> count or None
 *                          A GRANTED of the two shapes the daemon writes (offsets alone;
 *                          offsets, then the kept blocks' indices and their fixed-width keys):
 *                          its offsets go in at the front of the list `slots`, each kept block
 *                          as put(key, offset). None (nothing changed) for any other shape:
 *                          the caller decodes it with the checked decoder
 *                          (kvd_proto/records.py), which says what is wrong.
 *     .put(key, value)     set key's value (an offset replaces the entry that held it).
 *     .get(key) -> value or None; .pop(key) -> value or None; `key in t`; len(t).
 *     .discard_offsets(offsets)  the entries holding these offsets go (their slots left the
 *                          reserve: stored into, given back).
 *     .items() -> [(key, value)] (tests); .clear().
 *   An entry keeps the very offset object that went into `slots` (what list_discard finds by
 *   identity when a block is taken back).
 *
 *   list_discard(items, obj) -> bool (below): a kept block's slot taken back.
 *
 * Twins: kvd_proto/native.py PyKeptTable and py_list_discard; tests/unit/test_grants.py holds
 * them equal on random operations and on random and broken payloads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_kept.h"
#include "_records.h"

#define MAX_KEY_BYTES 128   /* kvd_proto/wire.py MAX_KEY_BYTES */
#define KEYS_HEADER 8       /* u32 count, u16 width, u16 zero (records.py _KEYS) */
#define EMPTY (-1)
#define TOMB (-2)           /* a bucket whose entry went: probes pass it, inserts reuse it */
#define CHUNK 32            /* keys or offsets whose lines a batch asks for at once */

typedef struct {
    int64_t value;          /* offset >= 0, or -(seq + 1) */
    uint64_t hash;          /* of the key */
    PyObject *offset;       /* the offset object granted (held), or NULL for a negative value */
    uint32_t len;           /* the key's length; UINT32_MAX: a free entry */
    uint32_t kb, ob;        /* its buckets in by_key and by_offset (they never move: a
                             * deletion leaves a TOMB, the table is rebuilt past many) */
} KeptEntry;

struct KeptTable {
    PyObject_HEAD
    KeptEntry *entries;
    unsigned char *keys;    /* `stride` bytes per entry: the longest key put so far (a
                             * namespace's keys have one width: the table stays small) */
    int32_t *by_key;        /* buckets: entry index, EMPTY or TOMB */
    int32_t *by_offset;     /* buckets of the entries with an offset */
    Py_ssize_t cap, used;   /* entries; nbuckets = 2 * cap, a power of two */
    Py_ssize_t tombs_k, tombs_o;   /* TOMBs in each: entries + TOMBs stay < half the buckets */
    Py_ssize_t stride;
    uint64_t mask;
    int32_t *free_stack;    /* the free entries, the next one to use on top: an array, so a
                             * batch knows which entries it will write before it writes them
                             * (apply asks for their lines together) */
    Py_ssize_t free_n;
};

static uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static uint64_t key_hash64(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (uint64_t)n;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
        h ^= h >> 29;
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, p + i, (size_t)(n - i));
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
    }
    return mix64(h);
}

static inline unsigned char *entry_key(const KeptTable *t, int32_t i) {
    return t->keys + (size_t)i * (size_t)t->stride;
}

static int table_alloc(KeptTable *t, Py_ssize_t cap, Py_ssize_t stride) {
    KeptEntry *entries = PyMem_Calloc((size_t)cap, sizeof *entries);
    unsigned char *keys = PyMem_Malloc((size_t)cap * (size_t)stride);
    int32_t *by_key = PyMem_Malloc((size_t)cap * 2 * sizeof *by_key);
    int32_t *by_offset = PyMem_Malloc((size_t)cap * 2 * sizeof *by_offset);
    int32_t *free_stack = PyMem_Malloc((size_t)cap * sizeof *free_stack);
    if (entries == NULL || keys == NULL || by_key == NULL || by_offset == NULL ||
        free_stack == NULL) {
        PyMem_Free(entries);
        PyMem_Free(keys);
        PyMem_Free(by_key);
        PyMem_Free(by_offset);
        PyMem_Free(free_stack);
        PyErr_NoMemory();
        return -1;
    }
    memset(by_key, 0xff, (size_t)cap * 2 * sizeof *by_key);
    memset(by_offset, 0xff, (size_t)cap * 2 * sizeof *by_offset);
    for (Py_ssize_t i = 0; i < cap; i++) {
        entries[i].len = UINT32_MAX;
        free_stack[i] = (int32_t)(cap - 1 - i);     /* entry 0 on top */
    }
    t->entries = entries;
    t->keys = keys;
    t->by_key = by_key;
    t->by_offset = by_offset;
    t->cap = cap;
    t->stride = stride;
    t->used = 0;
    t->tombs_k = t->tombs_o = 0;
    t->mask = (uint64_t)cap * 2 - 1;
    t->free_stack = free_stack;
    t->free_n = cap;
    return 0;
}

static void table_release(KeptTable *t) {
    if (t->entries != NULL)
        for (Py_ssize_t i = 0; i < t->cap; i++)
            if (t->entries[i].len != UINT32_MAX) Py_CLEAR(t->entries[i].offset);
    PyMem_Free(t->entries);
    PyMem_Free(t->keys);
    PyMem_Free(t->by_key);
    PyMem_Free(t->by_offset);
    PyMem_Free(t->free_stack);
    t->entries = NULL;
    t->keys = NULL;
    t->by_key = t->by_offset = NULL;
    t->free_stack = NULL;
    t->cap = t->used = 0;
    t->tombs_k = t->tombs_o = 0;
    t->mask = 0;
    t->free_n = 0;
}

static inline uint64_t offset_home(const KeptTable *t, int64_t value) {
    return mix64((uint64_t)value) & t->mask;
}

/* The bucket of `by_key` holding the entry of this key (*found 1), or where it would go: the
 * first TOMB its probe passed, else the EMPTY bucket ending it (*found 0). */
static uint64_t key_bucket(const KeptTable *t, const unsigned char *key, Py_ssize_t n,
                           uint64_t h, int *found) {
    uint64_t b = h & t->mask, free_at = UINT64_MAX;
    for (;;) {
        int32_t i = t->by_key[b];
        if (i == EMPTY) {
            *found = 0;
            return free_at != UINT64_MAX ? free_at : b;
        }
        if (i == TOMB) {
            if (free_at == UINT64_MAX) free_at = b;
        } else {
            const KeptEntry *e = &t->entries[i];
            if (e->hash == h && e->len == (uint32_t)n &&
                memcmp(entry_key(t, i), key, (size_t)n) == 0) {
                *found = 1;
                return b;
            }
        }
        b = (b + 1) & t->mask;
    }
}

static uint64_t offset_bucket(const KeptTable *t, int64_t value, int *found) {
    uint64_t b = offset_home(t, value), free_at = UINT64_MAX;
    for (;;) {
        int32_t i = t->by_offset[b];
        if (i == EMPTY) {
            *found = 0;
            return free_at != UINT64_MAX ? free_at : b;
        }
        if (i == TOMB) {
            if (free_at == UINT64_MAX) free_at = b;
        } else if (t->entries[i].value == value) {
            *found = 1;
            return b;
        }
        b = (b + 1) & t->mask;
    }
}

/* Entry `i` goes: TOMBs in its buckets, the entry back on the free list. */
static void entry_remove(KeptTable *t, int32_t i) {
    KeptEntry *e = &t->entries[i];
    t->by_key[e->kb] = TOMB;
    t->tombs_k++;
    if (e->value >= 0) {
        t->by_offset[e->ob] = TOMB;
        t->tombs_o++;
    }
    Py_CLEAR(e->offset);
    e->len = UINT32_MAX;
    t->free_stack[t->free_n++] = i;
    t->used--;
}

/* Removes the entry holding offset `value`, if any; the by_offset bucket where an entry of
 * that offset goes now (its TOMB, or where the probe found room). */
static uint64_t remove_offset(KeptTable *t, int64_t value) {
    int found;
    uint64_t ob = offset_bucket(t, value, &found);
    if (found) entry_remove(t, t->by_offset[ob]);
    return ob;
}

/* Entry `i` into its buckets: `kb` in by_key; in by_offset (an offset's entry) `ob`. Each is
 * EMPTY or a TOMB on the key's probe (removals leave TOMBs: what a probe found free stays). */
static void entry_link(KeptTable *t, int32_t i, uint64_t kb, uint64_t ob, int with_offset) {
    KeptEntry *e = &t->entries[i];
    if (t->by_key[kb] == TOMB) t->tombs_k--;
    t->by_key[kb] = i;
    e->kb = (uint32_t)kb;
    if (with_offset) {
        if (t->by_offset[ob] == TOMB) t->tombs_o--;
        t->by_offset[ob] = i;
        e->ob = (uint32_t)ob;
    }
}

/* Whether `more` entries, keys up to `stride` long, can go in without a rebuild: each put
 * takes one entry and may leave two TOMBs (its key's old entry, its offset's), and entries +
 * TOMBs stay at most half the buckets (`cap`; every probe ends at an EMPTY one), entries at
 * most 3/4 of `cap`. */
static int table_has_room(const KeptTable *t, Py_ssize_t more, Py_ssize_t stride) {
    Py_ssize_t tombs = t->tombs_k > t->tombs_o ? t->tombs_k : t->tombs_o;
    return stride <= t->stride && t->used + more <= t->cap / 2 + t->cap / 4 &&
           t->free_n >= more && t->used + tombs + 3 * more + 2 <= t->cap;
}

/* The table again, TOMBs gone, with room for `more` entries (`table_has_room`; the
 * capacity doubled as often as that takes), keys up to `stride` long. */
static int table_grow(KeptTable *t, Py_ssize_t more, Py_ssize_t stride) {
    KeptTable old = *t;
    Py_ssize_t cap = old.cap == 0 ? 64 : old.cap;
    while (old.used + more > cap / 2 + cap / 4 || old.used + 3 * more + 2 > cap) cap *= 2;
    if (table_alloc(t, cap, stride > old.stride ? stride : old.stride) < 0) {
        *t = old;
        return -1;
    }
    for (Py_ssize_t j = 0; j < old.cap; j++) {
        KeptEntry *e = &old.entries[j];
        if (e->len == UINT32_MAX) continue;
        int32_t i = t->free_stack[--t->free_n];
        t->entries[i] = *e;                          /* the offset object moves with it */
        memcpy(entry_key(t, i), old.keys + (size_t)j * (size_t)old.stride, e->len);
        t->used++;
        int found;
        uint64_t kb = key_bucket(t, entry_key(t, i), e->len, e->hash, &found);
        uint64_t ob = e->value >= 0 ? offset_bucket(t, e->value, &found) : 0;
        entry_link(t, i, kb, ob, e->value >= 0);
    }
    PyMem_Free(old.entries);
    PyMem_Free(old.keys);
    PyMem_Free(old.by_key);
    PyMem_Free(old.by_offset);
    PyMem_Free(old.free_stack);
    return 0;
}

/* table_put where the table has room for it (`table_has_room`) and `h` is the key's hash. */
static void table_put_hashed(KeptTable *t, const unsigned char *key, Py_ssize_t n, uint64_t h,
                             int64_t value, PyObject *offset) {
    int found;
    uint64_t b = key_bucket(t, key, n, h, &found);
    if (found) entry_remove(t, t->by_key[b]);     /* its bucket, a TOMB now, is b again */
    uint64_t ob = value >= 0 ? remove_offset(t, value) : 0;
    int32_t i = t->free_stack[--t->free_n];
    KeptEntry *e = &t->entries[i];
    e->value = value;
    e->hash = h;
    e->len = (uint32_t)n;
    e->offset = value >= 0 ? Py_NewRef(offset) : NULL;
    memcpy(entry_key(t, i), key, (size_t)n);
    t->used++;
    entry_link(t, i, b, ob, value >= 0);
}

/* key's value := value (offset: `offset`, the object granted, held; NULL for a negative
 * value). An offset replaces the entry that held it. */
static int table_put(KeptTable *t, const unsigned char *key, Py_ssize_t n, int64_t value,
                     PyObject *offset) {
    if (n > MAX_KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "a kept block's key is longer than 128 bytes");
        return -1;
    }
    if (!table_has_room(t, 1, n) && table_grow(t, 1, n) < 0) return -1;
    table_put_hashed(t, key, n, key_hash64(key, n), value, offset);
    return 0;
}

static int32_t table_find(const KeptTable *t, const unsigned char *key, Py_ssize_t n) {
    if (t->used == 0 || n > MAX_KEY_BYTES) return EMPTY;
    int found;
    uint64_t b = key_bucket(t, key, n, key_hash64(key, n), &found);
    return found ? t->by_key[b] : EMPTY;
}

int kept_table_contains(PyObject *table, PyObject *key) {
    KeptTable *t = (KeptTable *)table;
    return table_find(t, (const unsigned char *)PyBytes_AS_STRING(key),
                      PyBytes_GET_SIZE(key)) != EMPTY;
}

/* ------------------------------------------------------------------ the Python type */

static int key_arg(PyObject *key, const unsigned char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "a kept block's key must be bytes");
        return -1;
    }
    *p = (const unsigned char *)PyBytes_AS_STRING(key);
    *n = PyBytes_GET_SIZE(key);
    return 0;
}

static PyObject *entry_value(const KeptTable *t, int32_t i) {
    const KeptEntry *e = &t->entries[i];
    return e->offset != NULL ? Py_NewRef(e->offset) : PyLong_FromLongLong(e->value);
}

static PyObject *KeptTable_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "KeptTable() takes no arguments");
        return NULL;
    }
    KeptTable *t = (KeptTable *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    if (table_alloc(t, 64, 32) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void KeptTable_dealloc(KeptTable *t) {
    table_release(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t KeptTable_len(KeptTable *t) { return t->used; }

static int KeptTable_contains(KeptTable *t, PyObject *key) {
    if (!PyBytes_Check(key)) return 0;
    return table_find(t, (const unsigned char *)PyBytes_AS_STRING(key),
                      PyBytes_GET_SIZE(key)) != EMPTY;
}

static PyObject *KeptTable_get(KeptTable *t, PyObject *key) {
    const unsigned char *p;
    Py_ssize_t n;
    if (key_arg(key, &p, &n) < 0) return NULL;
    int32_t i = table_find(t, p, n);
    if (i == EMPTY) Py_RETURN_NONE;
    return entry_value(t, i);
}

static PyObject *KeptTable_pop(KeptTable *t, PyObject *key) {
    const unsigned char *p;
    Py_ssize_t n;
    if (key_arg(key, &p, &n) < 0) return NULL;
    if (t->used == 0 || n > MAX_KEY_BYTES) Py_RETURN_NONE;
    int found;
    uint64_t b = key_bucket(t, p, n, key_hash64(p, n), &found);
    if (!found) Py_RETURN_NONE;
    PyObject *value = entry_value(t, t->by_key[b]);
    if (value == NULL) return NULL;
    entry_remove(t, t->by_key[b]);
    return value;
}

static int value_arg(PyObject *obj, int64_t *value) {
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "a kept block's value must be an int");
        return -1;
    }
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *value = v;
    return 0;
}

static PyObject *KeptTable_put(KeptTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put(key, value)");
        return NULL;
    }
    const unsigned char *p;
    Py_ssize_t n;
    int64_t value;
    if (key_arg(args[0], &p, &n) < 0 || value_arg(args[1], &value) < 0) return NULL;
    if (table_put(t, p, n, value, args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

/* discard_offsets: the slots a store took (a few dozen a call), CHUNK at a time: the lines
 * of their buckets, then of the entries the buckets name, then of those entries' key buckets
 * are asked for together before any is used (the table is cold by the time the scheduler
 * calls: one miss after another cost ~60 ns each), then the entries go, in order. An offset
 * not an int stops it there (those before it are gone), as the twin does. */
static PyObject *KeptTable_discard_offsets(KeptTable *t, PyObject *offsets) {
    if (t->used == 0) Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(offsets, "offsets must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t values[CHUNK];
    int32_t at[CHUNK];          /* the entry each home bucket names (EMPTY: none, or no offset) */
    int failed = 0;
    for (Py_ssize_t c = 0; c < n && t->used && !failed; c += CHUNK) {
        Py_ssize_t k = 0, want = n - c < CHUNK ? n - c : CHUNK;
        for (; k < want; k++) {
            if (value_arg(items[c + k], &values[k]) < 0) {
                failed = 1;
                break;
            }
            if (values[k] >= 0) __builtin_prefetch(&t->by_offset[offset_home(t, values[k])]);
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            at[i] = values[i] >= 0 ? t->by_offset[offset_home(t, values[i])] : EMPTY;
            if (at[i] >= 0) __builtin_prefetch(&t->entries[at[i]]);
        }
        for (Py_ssize_t i = 0; i < k; i++)
            if (at[i] >= 0 && t->entries[at[i]].value == values[i])
                __builtin_prefetch(&t->by_key[t->entries[at[i]].kb], 1);
        for (Py_ssize_t i = 0; i < k && t->used; i++)
            if (values[i] >= 0) remove_offset(t, values[i]);
    }
    Py_DECREF(seq);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *KeptTable_items(KeptTable *t, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        const KeptEntry *e = &t->entries[i];
        if (e->len == UINT32_MAX) continue;
        PyObject *value = entry_value(t, (int32_t)i);
        PyObject *item = value == NULL ? NULL :
            Py_BuildValue("(y#N)", (const char *)entry_key(t, (int32_t)i), (Py_ssize_t)e->len,
                          value);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *KeptTable_clear(KeptTable *t, PyObject *unused) {
    if (t->used == 0) Py_RETURN_NONE;
    Py_ssize_t stride = t->stride ? t->stride : 32;
    table_release(t);
    if (table_alloc(t, 64, stride) < 0) return NULL;
    Py_RETURN_NONE;
}

static uint32_t read_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static PyObject *KeptTable_apply(KeptTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "apply(payload: bytes, slots: list)");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    PyObject *slots = args[1];
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
    for (Py_ssize_t i = 0; i < count; i++) {  /* an offset the table cannot hold: decoded */
        uint64_t v;
        memcpy(&v, p + 4 + 8 * i, 8);
        if (v > (uint64_t)INT64_MAX) Py_RETURN_NONE;
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
    /* Room for every kept block first: an error changes nothing, and no put rebuilds. */
    if ((m && !table_has_room(t, m, width) && table_grow(t, m, width) < 0) ||
        PyList_SetSlice(slots, 0, 0, offsets) < 0) {
        Py_DECREF(offsets);
        return NULL;
    }
    /* CHUNK keys at a time: their hashes, and the lines of their buckets and of the entries
     * they will take, asked for together before the first put (the table is cold when a step
     * starts: one miss after another cost ~0.2 us a block). */
    const unsigned char *keys = p + keys_start;
    uint64_t hashes[CHUNK];
    Py_ssize_t granted[CHUNK];           /* each kept block's position in `offsets` */
    int64_t values[CHUNK];               /* and its slot's offset */
    for (Py_ssize_t c = 0; c < m; c += CHUNK) {
        Py_ssize_t k = m - c < CHUNK ? m - c : CHUNK;
        for (Py_ssize_t i = 0; i < k; i++) {
            uint64_t h = hashes[i] = key_hash64(keys + (c + i) * width, width), v;
            granted[i] = (Py_ssize_t)read_u32(index + 4 * (c + i));
            memcpy(&v, p + 4 + 8 * granted[i], 8);
            values[i] = (int64_t)v;
            __builtin_prefetch(&t->by_key[h & t->mask], 1);
            __builtin_prefetch(&t->by_offset[offset_home(t, values[i])], 1);
            if (t->free_n > i) {
                int32_t e = t->free_stack[t->free_n - 1 - i];
                __builtin_prefetch(&t->entries[e], 1);
                __builtin_prefetch(entry_key(t, e), 1);
            }
        }
        for (Py_ssize_t i = 0; i < k; i++)
            table_put_hashed(t, keys + (c + i) * width, width, hashes[i], values[i],
                             PyList_GET_ITEM(offsets, granted[i]));
    }
    Py_DECREF(offsets);
    return PyLong_FromSsize_t(count);
}

static PyMethodDef KeptTable_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))KeptTable_apply, METH_FASTCALL,
     "apply(payload, slots) -> the slots granted, or None: a GRANTED applied to a reserve"},
    {"put", (PyCFunction)(void (*)(void))KeptTable_put, METH_FASTCALL,
     "put(key, value): key's value (an offset replaces the entry that held it)"},
    {"get", (PyCFunction)KeptTable_get, METH_O, "get(key) -> value or None"},
    {"pop", (PyCFunction)KeptTable_pop, METH_O, "pop(key) -> value or None (removed)"},
    {"discard_offsets", (PyCFunction)KeptTable_discard_offsets, METH_O,
     "discard_offsets(offsets): the entries holding these offsets go"},
    {"items", (PyCFunction)KeptTable_items, METH_NOARGS, "items() -> [(key, value)]"},
    {"clear", (PyCFunction)KeptTable_clear, METH_NOARGS, "clear(): no entry"},
    {NULL}};

static PySequenceMethods KeptTable_as_sequence = {
    .sq_length = (lenfunc)KeptTable_len,
    .sq_contains = (objobjproc)KeptTable_contains,
};

PyTypeObject KeptTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd_proto._native.KeptTable",
    .tp_basicsize = sizeof(KeptTable),
    .tp_dealloc = (destructor)KeptTable_dealloc,
    .tp_as_sequence = &KeptTable_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The evicted blocks a session's granted slots still hold: key -> offset, or "
              "-(seq + 1) while taken back (kvd_proto/_grants.c).",
    .tp_methods = KeptTable_methods,
    .tp_new = KeptTable_new,
};

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
