/* The engine's Lookups object (kvd_proto/_native.c), shared with the step's compiled fast
 * paths (kvd_proto/_steps.c). */
#ifndef KVD_LOOKUPS_H
#define KVD_LOOKUPS_H
#include <Python.h>
#include <stdint.h>

#define MAX_PROBE 64
#define STATE_FREE 0
#define STATE_STORING 1
#define STATE_READY 2
#define AHEAD_MAX 16     /* keys a lookahead reads at most */

typedef struct {
    Py_buffer buf;
    int bound;
    uint64_t *buckets;
    uint64_t mask;
    uint32_t *flags;       /* kvd_proto/below_layout.py FLAGS_OFFSET: FLAG_ASK, FLAG_WAIT */
} Below;

typedef struct {
    Py_buffer buf;
    int bound;
    uint32_t *buckets;
    uint64_t mask;
    uint64_t *meta;
    uint64_t capacity;
    unsigned char *keys;
    Py_ssize_t width;
    uint64_t per_extent, extent_bytes, stride;
} Geometry;

/* One HIT of this step: the key (held) and its slot's offset. */
typedef struct {
    PyObject *key;
    uint64_t offset;
} HitEntry;

typedef struct {
    PyObject_HEAD
    Geometry g;
    /* This step's HITs (kvd_proto/_native.c, "this step's HITs"): a log in the order they
     * were answered, and a dict the log is moved into when it is full or a key must be
     * found by value. */
    HitEntry *hit_log;
    Py_ssize_t hit_n, hit_cap;
    Py_ssize_t pin_cursor;   /* where the last pin's keys ended in the log */
    PyObject *hits;      /* dict: key -> offset, HITs moved out of the log */
    PyObject *stores;    /* dict: key -> the engine's own store in flight (a Store tuple,
                          * kvd_proto/native.py; _steps.c reads and changes it) */
    PyObject *miss, *hit;
    PyObject *fallback;  /* callable(key): every other case */
    PyObject *kept;      /* a KeptTable (kvd_proto/_kept.h; or any sized container) or
                          * NULL: keys of evicted blocks this engine's granted slots still
                          * hold (kvd_client/offload/reserve.py): the fallback's */
    Below below;         /* the namespace's "held below" table, when bound */
    int enabled;
    unsigned long long lookups, hit_count, miss_count;
    /* Lookahead (kvd_proto/_native.c, lookahead()): the request context of the last
     * lookups, where its next keys start in the context's key order, whether it has none
     * (off), what to read next time (batch), and the batch read: its keys (held), their
     * slots (-1: not READY when read) and meta words, the next one to answer. */
    PyObject *ahead_ctx;
    Py_ssize_t ahead_pos;
    int ahead_off, ahead_batch, ahead_n, ahead_i;
    PyObject *ahead_keys[AHEAD_MAX + 1];
    int64_t ahead_slot[AHEAD_MAX + 1];
    uint64_t ahead_word[AHEAD_MAX + 1];
    unsigned long long ahead_read;      /* keys read ahead (batches' keys, the asked one too) */
} Lookups;

/* The slot holding `key` (bytes; storing or ready), its meta word in *word; -1 if none. */
int64_t lookups_probe(const Lookups *self, PyObject *key, uint64_t *word);
/* `key`'s home bucket in the index, its cache line asked for (a probe of many keys asks for
 * every line first, so that their misses overlap instead of following one another). */
uint64_t lookups_prefetch(const Lookups *self, PyObject *key);
/* The meta word and key lines of the slots the first buckets from `bucket` name, asked for
 * (after lookups_prefetch's line has come: a probe then waits for none of them). */
void lookups_prefetch_slots(const Lookups *self, uint64_t bucket);
/* lookups_probe from the home bucket lookups_prefetch gave. */
int64_t lookups_probe_at(const Lookups *self, uint64_t bucket, PyObject *key, uint64_t *word);
/* The pool offset of `slot`. */
uint64_t lookups_offset(const Lookups *self, uint64_t slot);
/* The offset of a HIT of this step for `key`: 1 (in *offset), 0 none, -1 an error. `*hint`
 * is where to look first (-1: nowhere); it is set after the entry found, so the keys of one
 * request, answered one after another, are found in one pass. */
int lookups_hit_find(Lookups *self, PyObject *key, Py_ssize_t *hint, uint64_t *offset);

/* kvd_proto/_steps.c: the scheduler's steps (their one Python twin is the session's own path,
 * kvd_client/offload/) */
PyObject *Lookups_store(Lookups *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Lookups_pin(Lookups *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Lookups_complete(Lookups *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Lookups_settle(Lookups *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_key_positions(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_same_set(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
extern const char LOOKUPS_STORE_DOC[];
extern const char LOOKUPS_COMPLETE_DOC[];
extern const char LOOKUPS_SETTLE_DOC[];
extern const char LOOKUPS_PIN_DOC[];

#endif
