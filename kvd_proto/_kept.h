/* The evicted blocks a session's granted slots still hold (kvd_proto/_grants.c), for the
 * engine's lookups (kvd_proto/_native.c). */
#ifndef KVD_KEPT_H
#define KVD_KEPT_H
#include <Python.h>

typedef struct KeptTable KeptTable;
extern PyTypeObject KeptTableType;

/* Whether the KeptTable `table` has an entry for the bytes `key` (no error possible). */
int kept_table_contains(PyObject *table, PyObject *key);

#endif
