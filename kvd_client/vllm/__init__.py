"""vLLM 0.33 plug-in: load with spec_name "KvdOffloadingSpec", spec_module_path "kvd_client.vllm".

Importing this package imports vLLM; the rest of kvd_client does not.
"""

from .offloading_spec import KvdOffloadingSpec

__all__ = ["KvdOffloadingSpec"]
