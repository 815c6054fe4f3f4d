"""vLLM 0.33 plug-in: load with spec_name "KvdOffloadingSpec", spec_module_path "kvd_client.vllm".

Importing this package imports vLLM; the rest of kvd_client does not.
"""

from kvd_client.vllm.compat import check as _check_vllm

VLLM_VERSION = _check_vllm()        # a clear error at engine start on an unsupported vLLM

from kvd_client.vllm.offloading_spec import KvdOffloadingSpec  # noqa: E402

__all__ = ["VLLM_VERSION", "KvdOffloadingSpec"]
