"""Elastic training on 2 GPUs (tcp mode, NCCL for the CUDA tensors): 2 workers -> 1 -> 2.

The worker of "host" 127.0.0.1 (GPU 1) SIGKILLs itself mid-epoch. The survivor (localhost,
GPU 0) restores the last commit and goes on alone; its old NCCL communicators and fusion
buffers are released at the reset. After the blacklist cooldown (1-2 s) 127.0.0.1 is back,
the driver announces it, a new worker starts on GPU 1, receives the state by broadcast, and
the two finish the epoch. Checks: every sample of the dataset was committed exactly once,
the weights equal the closed-form SGD-with-momentum result for the steps taken, both ranks
agree, and the sizes went 2 -> 1 -> 2.

Run on the GPU machine: `benchmarks/run_gpu_suite.sh tests` (or
`python3 -m pytest -q tests/gpu/test_elastic_gpu.py`). Skipped without 2 GPUs unless
RINGVOD_TEST_REQUIRE names gpu.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests._elastic_job import Job, no_orphans
from tests._spmd import skip_or_fail

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]


@pytest.mark.timeout(240)
def test_gpu_elastic_kill_and_recover(tmp_path: Path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        skip_or_fail("needs 2 CUDA GPUs", "gpu")
    steps_at_two = 8  # batches before the kill
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "--max-np", "2", "-H",
                         "localhost:1,127.0.0.1:1", "--blacklist-cooldown-range", "1", "2"],
              {"ET_TORCH": "1", "ET_CUDA": "1", "ET_DATASET": "240", "ET_BATCH": "2",
               "ET_COMMIT": "2", "ET_SLEEP": "0.1", "ET_KILL": f"127.0.0.1:{steps_at_two + 1}",
               "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1"}, 200)
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [r["rank"] for r in res] == [0, 1], out
    w, buf = 0.0, None
    for s in range(res[0]["step"]):
        g = float(s % 7 - 3)
        buf = g if buf is None else 0.5 * buf + g
        w -= 0.5 * buf
    for r in res:
        assert sorted(r["seen"]) == list(range(240)), r["seen"]
        assert r["log"] == list(range(r["step"]))
        sizes = r["sizes"]
        assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
        assert r["w"] == pytest.approx([w] * 4, abs=1e-4), (r["w"], w)
    assert res[0]["w"] == res[1]["w"]
    assert "blacklisting host 127.0.0.1 for" in out and "hosts added" in out, out
    no_orphans(job)
