"""Builds the C extensions: kvd_proto._native, the shared index's per-key loops, the
scheduler's common store and load calls and the channel rings' appends and reads, and
kvd_server.tiers.disk._blockio, the disk tier's batched block I/O (everything else is in
pyproject.toml). Optional: without a C compiler and Python's headers the build goes on and kvd
runs on the pure-Python twins (kvd_proto/native.py, kvd_server/tiers/disk/block_io.py)."""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
         "-Wno-unused-parameter", "-Wno-cast-function-type"]

setup(ext_modules=[
    Extension("kvd_proto._native",
              sources=["kvd_proto/_native.c", "kvd_proto/_records.c", "kvd_proto/_steps.c",
                       "kvd_proto/_rings.c", "kvd_proto/_decode.c", "kvd_proto/_grants.c"],
              depends=["kvd_proto/_records.h", "kvd_proto/_lookups.h", "kvd_proto/_rings.h", "kvd_proto/_kept.h"],
              extra_compile_args=FLAGS, optional=True),
    # A copy plan's runs in one call, large ones streamed (twin: kvd_client/dataplane/cpu.py).
    Extension("kvd_client.dataplane._copy", sources=["kvd_client/dataplane/_copy.c"],
              extra_compile_args=["-pthread", *FLAGS], extra_link_args=["-pthread"],
              optional=True),
    # The disk tier's batched block I/O (twin: kvd_server/tiers/disk/block_io.py).
    Extension("kvd_server.tiers.disk._blockio", sources=["kvd_server/tiers/disk/_blockio.c"], libraries=["dl"],
              extra_compile_args=["-D_GNU_SOURCE", *FLAGS], optional=True),
])
