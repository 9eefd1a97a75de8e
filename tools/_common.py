"""Set-up the tools share, done on import (import it before torch and the repository's
packages): NCCL's and torch's multicast (NVLS) switched off unless the environment says
otherwise, and the repository root on `sys.path` so `collective` and `frameworks` import from
this tree."""
import os
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
