/* The channel's record encoders (kvd_proto/_records.c) and decoder (_decode.c), for the module table in _native.c. */
#ifndef KVD_RECORDS_H
#define KVD_RECORDS_H
#include <Python.h>

PyObject *native_keys_block(PyObject *self, PyObject *keys);
PyObject *native_keys_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* The strict decoder of the keyed up records (kvd_proto/_decode.c). */
PyObject *native_decode_keyed(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
