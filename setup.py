"""Builds kvd_proto._native, the shared index's per-key loops in C (everything else is in
pyproject.toml). Optional: without a C compiler and Python's headers the build goes on and kvd
runs on the pure-Python twins (kvd_proto/native.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvd_proto._native", sources=["kvd_proto/_native.c", "kvd_proto/_records.c"],
                             depends=["kvd_proto/_records.h"],
                             extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra",
                                                 "-Wno-missing-field-initializers",
                                                 "-Wno-unused-parameter",
                                                 "-Wno-cast-function-type"],
                             optional=True)])
