/* The channel's record encoders (kvd_proto/_records.c), decoder (_decode.c) and grants (_grants.c), for the module table in _native.c. */
#ifndef KVD_RECORDS_H
#define KVD_RECORDS_H
#include <Python.h>

/* The channel's record kinds (docs/attach.md, "The channel"): defined here once for the C code;
 * kvd_proto/record_kinds.py is their Python side, held equal to these by
 * tests/unit/test_record_kinds_one_source.py. Up: engine -> daemon. */
#define KIND_STORE 1
#define KIND_COMPLETE_STORE 2
#define KIND_PIN 3
#define KIND_COMPLETE_LOAD 4
#define KIND_TOUCH 5
#define KIND_REQUEST_FINISHED 6
#define KIND_RESERVE 7
#define KIND_RESET 8
#define KIND_TAKE_EVENTS 9
#define KIND_COUNTERS 10
#define KIND_RELEASE_HELD 11
#define KIND_RETURN_SLOTS 12
#define KIND_PROMOTE 13
#define KIND_RESTORE 14
#define KIND_HINT 15
#define KIND_FIND 16
/* Down: daemon -> engine. */
#define KIND_GRANTED 1
#define KIND_RESET_DONE 2
#define KIND_EVENTS 3
#define KIND_REJECTED 4
#define KIND_FOUND 5

PyObject *native_keys_block(PyObject *self, PyObject *keys);
PyObject *native_keys_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* The strict decoder of the keyed up records (kvd_proto/_decode.c). */
PyObject *native_decode_keyed(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* A reserve's top-up applied, and its kept blocks compacted (kvd_proto/_grants.c). */
PyObject *native_list_discard(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
