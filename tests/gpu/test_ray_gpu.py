"""ringvod on Ray with GPUs: `RayExecutor(use_gpu=True)` and `HorovodTrainer` on 2 GPUs (NCCL).

Each worker must see the GPUs of its node in local-rank order (`CUDA_VISIBLE_DEVICES`), so that
`torch.cuda.set_device(hvd.local_rank())` is the GPU Ray gave it, and a CUDA allreduce runs
through the NCCL engine. Skipped without Ray, CUDA or 2 GPUs (failed instead when
RINGVOD_TEST_REQUIRE names ray, or gpu for CUDA).

    python -m pytest -q tests/gpu/test_ray_gpu.py      # or: benchmarks/run_gpu_suite.sh tests
"""
from __future__ import annotations

import os
import sys
import tempfile

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402

from tests._spmd import REPO, skip_or_fail  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_gpus():
    try:
        import ray
    except ImportError as exc:
        skip_or_fail(f"needs Ray: {exc}", "ray")
    try:
        import torch
    except ImportError as exc:
        skip_or_fail(f"needs torch: {exc}", "gpu")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        skip_or_fail("needs 2 CUDA GPUs", "gpu")
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH"))
                                               if p)
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def _gpu_allreduce():
    import torch

    import horovod.torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    x = torch.full((1 << 20,), float(hvd.rank() + 1), device="cuda")
    y = hvd.allreduce(x, op=hvd.Sum, name="x")
    torch.cuda.synchronize()
    return {"rank": hvd.rank(), "local_rank": hvd.local_rank(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": torch.cuda.current_device(), "ok": bool((y == 3.0).all()),
            "uuid": str(torch.cuda.get_device_properties(hvd.local_rank()).uuid)}


def test_executor_use_gpu_sees_node_gpus_and_uses_nccl(ray_gpus):
    from horovod.ray import RayExecutor
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2, use_gpu=True)
    ex.start()
    try:
        out = ex.run(_gpu_allreduce)
    finally:
        ex.shutdown()
    assert [o["ok"] for o in out] == [True, True], out
    assert out[0]["visible"] == out[1]["visible"] and len(out[0]["visible"].split(",")) == 2
    assert [o["device"] for o in out] == [0, 1] and out[0]["uuid"] != out[1]["uuid"], out


def _train_loop():
    import ray.train
    ray.train.report(_gpu_allreduce())


def test_horovod_trainer_use_gpu(ray_gpus):
    from ray.train import RunConfig, ScalingConfig

    from horovod.ray import HorovodTrainer
    result = HorovodTrainer(_train_loop, scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
                            run_config=RunConfig(storage_path=tempfile.mkdtemp())).fit()
    assert result.error is None and result.metrics["ok"] is True, result.metrics
