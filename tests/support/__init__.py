"""The harness the multi-process, fault, vLLM and GPU tests share: a real `kvd serve` on a
temporary socket (daemon.py), engine sessions on raw stubs (engine.py), client processes
(client.py), bounded waits (waits.py) and the pytest fixtures over them (fixtures.py).

A library, not a conftest: test files import what they use from these modules, and each
directory's conftest.py re-exports the fixtures it wants, so pytest finds them there.
"""
