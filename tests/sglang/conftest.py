"""SGLang 0.5.23's own code for kvd's SGLang backend tests (installed by `make test`; where it
is missing, these tests skip and say so). Its torchvision import chains get inert stand-ins
first (tests/support/sglang_env.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed (make sglang-env)")

from tests.support.sglang_env import install_stand_ins

install_stand_ins()

from tests.support.fixtures import daemon, start_daemon, workdir  # noqa: E402, F401

