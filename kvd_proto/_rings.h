/* A channel ring's appends and reads (kvd_proto/_rings.c), for the module table in _native.c. */
#ifndef KVD_RINGS_H
#define KVD_RINGS_H
#include <Python.h>

PyObject *native_ring_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_ring_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
