"""SPMD script: HOROVOD_AUTOTUNE=1 with a torch DistributedOptimizer (gradient buckets), one
step per sample, every knob tuned (fusion threshold, cycle time, bucket size, response cache).

Every step's averaged gradients are checked against a manual allreduce average of the same
gradients computed by a reference copy of the model; every rank records the bucket size and
bucket names of every step. At the end all ranks must have used the same buckets in every step,
tried every bucket size of the grid, switched the response cache off and on at the same
negotiation rounds, hold identical weights, and rank 0's CSV log (argv[1]) must hold Horovod's
columns plus `bucket_cap_mb`, with the real cache setting of every row and the chosen values
last.
"""
import sys

import torch

import horovod.torch as hvd
from collective import _current

log_path = sys.argv[1]
hvd.init()
me, n = hvd.rank(), hvd.size()
tuning = _current.current().coordinator.tuning


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []  # 1 MB of weights per layer, 6 MB in all: 1, 4, 25 and 64 MB buckets differ
    for _ in range(3):
        layers += [torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256)]
    return torch.nn.Sequential(*layers)


model, ref = make_model(), make_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=model.named_parameters())
reducer = opt._hvd_reducer
assert reducer.schedule is not None, "autotune must get the optimizer's bucket schedule"
plans = []
step = 0
after = None  # steps run once tuning ended (its last bucket switch applies 2 steps later)
while after is None or after < 3:
    if after is not None:
        after += 1
    step += 1
    g = torch.Generator().manual_seed(1000 * step + me)
    x, y = torch.randn(4, 256, generator=g), torch.randn(4, 256, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    # the reference: this rank's own gradient at the same weights, averaged by hand
    ref.load_state_dict(model.state_dict())
    ref.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    want = hvd.grouped_allreduce([p.grad for p in ref.parameters()], op=hvd.Average,
                                 name="reference")
    for (pname, p), w in zip(model.named_parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, s=step, q=pname: f"step {s} {q}: {m}")
    with opt.skip_synchronize():
        opt.step()
    plans.append((reducer.cap_mb, [b.name for b in reducer.buckets]))
    done = bool(tuning.retunes) and not tuning.retunes[-1][1].active
    if after is None and step % 4 == 0 and hvd.allreduce(
            torch.tensor([1.0 if done else 0.0]), op=hvd.Min, name="done").item() == 1.0:
        after = 0
    assert step < 600, f"autotune did not finish in {step} steps: {tuning.retunes}"

# Every rank used the same buckets in every step and switched at the same rounds.
assert hvd.broadcast_object(plans, root_rank=0, name="plans") == plans, "bucket plans differ"
mine = [(r, p.fusion_threshold, p.cycle_time_ms, p.bucket_cap_mb, p.cache_enabled, p.active,
         p.bucket_from_step) for r, p in tuning.retunes]
assert hvd.broadcast_object(mine, root_rank=0, name="retunes") == mine, "switches differ"
assert hvd.broadcast_object(tuning.bucket_plan, root_rank=0, name="bplan") == tuning.bucket_plan
sizes = [cap for cap, _ in plans]
assert {1.0, 4.0, 25.0, 64.0} <= set(sizes), (sizes, tuning.bucket_plan)
for from_step, cap in tuning.bucket_plan:  # each size took effect right after its step
    assert sizes[from_step - 1] == cap, (from_step, cap, sizes)
caches = [c for *_, c, _a, _s in mine]
assert False in caches and caches[-1] == (tuning.cache_capacity > 0), mine
ps0 = _current.current().member_sets()[0]
assert ps0.cache.capacity == tuning.cache_capacity
final = tuning.retunes[-1][1]
assert not final.active and sizes[-1] == final.bucket_cap_mb == reducer.cap_mb
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
assert torch.equal(hvd.broadcast(flat, root_rank=0, name="weights"), flat), "weights differ"

if me == 0:
    with open(log_path) as f:
        lines = f.read().splitlines()
    assert lines[0] == ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,"
                        "cache_enabled,cycle_time_ms,tensor_fusion_threshold,score,"
                        "bucket_cap_mb"), lines[0]
    rows = [[float(v) for v in line.split(",")] for line in lines[1:]]
    assert all(len(r) == 8 for r in rows) and len(rows) >= 10, rows
    assert {r[3] for r in rows} == {0.0, 1.0}, rows  # the cache column shows the real value
    assert {1.0, 4.0, 25.0, 64.0} <= {r[7] for r in rows}, rows
    last = rows[-1]
    assert (last[3] == float(final.cache_enabled) and last[4] == final.cycle_time_ms
            and last[5] * 1024 * 1024 == final.fusion_threshold
            and last[7] == final.bucket_cap_mb), (last, final)
hvd.shutdown()
print(f"rank {me}: autotune with DistributedOptimizer ok after {step} steps, "
      f"{len(mine)} switches, bucket sizes {sorted(set(sizes))}, final {final}", flush=True)
