"""The CUDA backend imports without CUDA and refuses clearly when there is no GPU."""

from __future__ import annotations

import importlib

import pytest


def test_imports_without_cuda():
    mod = importlib.import_module("kvd_client.dataplane.cuda")
    assert hasattr(mod, "CudaBackend")


def test_constructing_without_gpu_is_a_clear_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from kvd_client.dataplane.cuda import CudaBackend

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        CudaBackend()


def test_cuda_and_cpu_share_the_planner():
    from kvd_client.dataplane import cpu, cuda, planner

    assert cpu.CopyPlan is planner.CopyPlan and cuda.CopyPlan is planner.CopyPlan
