"""Data-parallel PyTorch training with ringvod on a Ray cluster, three ways.

    python examples/ray/pytorch_ray.py --api executor   # horovod.ray.RayExecutor
    python examples/ray/pytorch_ray.py --api trainer    # horovod.ray.HorovodTrainer (Ray Train)
    python examples/ray/pytorch_ray.py --api torch      # ray.train.torch.TorchTrainer + hvd.init()

Add `--address auto` to join a running cluster (`ray start --head` ...), `--use-gpu` to give
each worker a GPU (collectives then run on NCCL). The same training function serves all three:
it is ordinary Horovod code.
"""
from __future__ import annotations

import argparse
import os
import tempfile


def train(config: dict) -> dict:
    import torch

    import horovod.torch as hvd
    hvd.init()
    device = "cpu"
    if config.get("use_gpu"):
        torch.cuda.set_device(hvd.local_rank())
        device = "cuda"
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"] * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    gen = torch.Generator().manual_seed(1000 + hvd.rank())  # each rank its own shard
    w_true = torch.arange(32, dtype=torch.float32) / 32
    loss = None
    for epoch in range(config["epochs"]):
        for _ in range(20):
            x = torch.randn(64, 32, generator=gen)
            y = (x @ w_true)[:, None]
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        avg = hvd.allreduce(loss.detach(), name="epoch_loss").item()
        if config.get("report"):  # under Ray Train: metrics and a checkpoint from rank 0
            import ray.train
            checkpoint = None
            if hvd.rank() == 0:
                d = tempfile.mkdtemp()
                torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"epoch": epoch, "loss": avg}, checkpoint=checkpoint)
        elif hvd.rank() == 0:
            print(f"epoch {epoch}: loss {avg:.4f}", flush=True)
    return {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "size": hvd.size(),
            "loss": avg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--api", choices=["executor", "trainer", "torch"], default="executor")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--use-gpu", action="store_true")
    ap.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    args = ap.parse_args()
    import ray
    ray.init(address=args.address)
    config = {"lr": 0.01, "epochs": args.epochs, "use_gpu": args.use_gpu}

    if args.api == "executor":
        from horovod.ray import RayExecutor
        settings = RayExecutor.create_settings(timeout_s=60)
        executor = RayExecutor(settings, num_workers=args.num_workers, use_gpu=args.use_gpu)
        executor.start()
        try:
            for r in executor.run(train, args=(config,)):
                print(r)
        finally:
            executor.shutdown()
        return

    from ray.train import RunConfig, ScalingConfig
    scaling = ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu)
    run_config = RunConfig(storage_path=tempfile.mkdtemp(prefix="ringvod_ray_"),
                           name=f"ringvod_{args.api}")
    config["report"] = True
    if args.api == "trainer":
        from horovod.ray import HorovodConfig, HorovodTrainer
        trainer = HorovodTrainer(train, train_loop_config=config,
                                 horovod_config=HorovodConfig(timeout_s=60),
                                 scaling_config=scaling, run_config=run_config)
    else:
        from ray.train.torch import TorchTrainer
        trainer = TorchTrainer(train, train_loop_config=config, scaling_config=scaling,
                               run_config=run_config)
    result = trainer.fit()
    print("metrics:", result.metrics)
    print("checkpoint:", result.checkpoint)


if __name__ == "__main__":
    main()
