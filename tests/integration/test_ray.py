"""ringvod on Ray: `RayExecutor`, the Ray Train `HorovodTrainer`, and `TorchTrainer` with hvd.

One local Ray cluster for the whole module: two raylets on this machine
(`ray.cluster_utils.Cluster`), i.e. two Ray nodes with 2 CPUs each, so that multi-node layouts
are real (hosts are keyed by Ray node id). Skipped, with the reason, when Ray is not installed;
the ImportError test runs without Ray.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests._spmd import skip_or_fail

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import ray  # noqa: F401
    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason='Ray is not installed (pip install ".[ray]")')
CPUS_PER_NODE = 2


def test_missing_ray_gives_an_import_error_naming_the_extra():
    code = ("import sys, json\nsys.modules['ray'] = None\n"
            "try:\n    import horovod.ray\n"
            "except ImportError as e:\n    print(json.dumps(str(e)))\n"
            "else:\n    print(json.dumps('no error'))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    msg = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 'pip install ".[ray]"' in msg and "Ray" in msg, msg


@pytest.fixture(scope="module")
def cluster():
    if not HAVE_RAY:
        skip_or_fail('Ray is not installed (pip install ".[ray]")', "ray")
    import ray
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    # Functions of this module travel by value: workers need not import the test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    # Ray starts its workers at a lower CPU priority (niceness 15); on a loaded 2-core machine
    # they then starve behind any busy process and Ray Train's start-up outlasts the timeouts.
    # The tests check behaviour, not Ray's scheduling, so the workers run at normal priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": False})
    c.worker_node = c.add_node(num_cpus=CPUS_PER_NODE)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _all_cpus_free(timeout: float = 30.0) -> bool:
    import ray
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) >= 2 * CPUS_PER_NODE:
            return True
        time.sleep(0.2)
    return False


class Counter:
    def __init__(self, start):
        self.n = start

    def bump(self):
        self.n += 1
        return self.n


def _train(steps):
    import torch

    import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different initial weights: broadcast must fix them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"rank": hvd.rank(), "size": hvd.size(), "weights": end.tolist(),
            "moved": float((end - start).abs().max())}


def _layout():
    import numpy as np

    import collective as hvd  # numpy tensors: no torch import in 4 workers on a 2-core box
    hvd.init()
    return {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "node": os.environ["HOROVOD_HOSTNAME"],
            "sum": float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])}


@needs_ray
@pytest.mark.timeout(180)
def test_static_executor_trains_with_identical_weights_and_executes(cluster):
    from horovod.ray import RayExecutor
    settings = RayExecutor.create_settings(timeout_s=60)
    ex = RayExecutor(settings, num_workers=2, cpus_per_worker=1)
    ex.start(executable_cls=Counter, executable_args=[10])
    try:
        out = ex.run(_train, args=(5,))
        assert [o["rank"] for o in out] == [0, 1] and {o["size"] for o in out} == {2}
        assert out[0]["weights"] == out[1]["weights"]  # bitwise identical
        assert out[0]["moved"] > 0
        assert ex.execute(lambda c: c.bump()) == [11, 11]
        assert ex.execute_single(lambda c: c.bump()) == 12
        assert ex.execute(lambda c: c.n) == [12, 11]
        refs = ex.run_remote(lambda a, b=0: a + b, args=(1,), kwargs={"b": 2})
        import ray
        assert ray.get(refs) == [3, 3]
        nodes = [w.node_id for w in ex.worker_info]
        assert ex.run(lambda: os.environ["HOROVOD_HOSTNAME"]) == nodes
    finally:
        ex.shutdown()
    assert _all_cpus_free(), "actors or the placement group outlived shutdown()"
    with pytest.raises(RuntimeError, match="not started"):
        ex.run(lambda: 1)


@needs_ray
@pytest.mark.timeout(180)
def test_multi_node_layout_follows_the_ray_nodes(cluster):
    from horovod.ray import RayExecutor
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2,
                     num_workers_per_host=2)
    ex.start()
    try:
        out = ex.run(_layout)
    finally:
        ex.shutdown()
    nodes = [o["node"] for o in out]
    assert len(set(nodes)) == 2 and nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert [o["local_rank"] for o in out] == [0, 1, 0, 1]
    assert [o["cross_rank"] for o in out] == [0, 0, 1, 1]
    assert {o["local_size"] for o in out} == {2} and {o["cross_size"] for o in out} == {2}
    assert {o["sum"] for o in out} == {4.0}
    assert _all_cpus_free()


def _crash_rank_1():
    import numpy as np

    import collective as hvd
    hvd.init()
    hvd.allreduce(np.ones(4), name="before")
    if hvd.rank() == 1:
        os._exit(3)
    for i in range(100):
        hvd.allreduce(np.ones(4), name=f"after.{i}")
        time.sleep(0.05)


@needs_ray
@pytest.mark.timeout(180)
def test_lost_worker_names_worker_and_node_and_leaves_no_actor(cluster):
    from horovod.ray import RayExecutor, WorkerLostError
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    ex.start()
    info = ex.worker_info
    with pytest.raises(WorkerLostError) as err:
        ex.run(_crash_rank_1)
    msg = str(err.value)
    assert err.value.rank == 1 and "rank 1" in msg, msg
    assert info[1].node_id in msg and info[1].node_ip in msg, msg
    assert ex.workers == []
    assert _all_cpus_free(), "actors left behind after a failure"


def _raise_on_rank_1():
    import numpy as np

    import collective as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("user error on rank 1")
    hvd.allreduce(np.ones(2), name="waits_for_rank_1")  # rank 0 waits here for rank 1
    return hvd.rank()


@needs_ray
@pytest.mark.timeout(180)
def test_exception_in_a_worker_reaches_the_driver_as_itself(cluster):
    from horovod.ray import RayExecutor
    # Rank 1 raises while rank 0 waits for it in an allreduce: run() raises rank 1's own
    # exception (type, message, the worker's traceback, a note naming rank and node) instead
    # of hanging, and stops the job. On Python 3.10, which has no add_note, the driver raised
    # an AttributeError from adding the note instead of the user's exception.
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    ex.start()
    info = ex.worker_info
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="user error on rank 1") as err:
        ex.run(_raise_on_rank_1)
    assert time.monotonic() - t0 < 60, "the other worker kept run() waiting"
    assert "_raise_on_rank_1" in str(err.value)  # the worker's traceback
    notes = getattr(err.value, "__notes__", [])
    assert len(notes) == 1 and f"rank 1 on Ray node {info[1].node_id}" in notes[0], notes
    assert ex.workers == []
    assert _all_cpus_free(), "actors left behind after a failure"
    ex.start()  # the executor starts again
    try:
        assert ex.run(lambda: 7) == [7, 7]
    finally:
        ex.shutdown()


@needs_ray
@pytest.mark.timeout(180)
def test_worker_lost_error_reaches_the_caller_of_a_task_that_drives_the_executor(cluster):
    import pickle

    import ray

    from horovod.ray import WorkerLostError
    err = WorkerLostError("the worker of rank 1 was lost", 1, "node-x", "10.0.0.2")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.rank, back.node_id, back.node_ip) == (
        WorkerLostError, str(err), 1, "node-x", "10.0.0.2")

    @ray.remote(num_cpus=0)
    def trial():  # a Ray task (e.g. a Tune trial) running a job whose worker dies
        from horovod.ray import RayExecutor
        ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
        ex.start()
        try:
            ex.run(_crash_rank_1)
        finally:
            ex.shutdown()

    # Ray returns the task's exception pickled: WorkerLostError could not be unpickled
    # (its __init__ takes four arguments), so the caller got Ray's UnserializableException.
    with pytest.raises(WorkerLostError) as caught:
        ray.get(trial.remote(), timeout=150)
    assert caught.value.rank == 1 and "rank 1" in str(caught.value), str(caught.value)
    assert caught.value.node_id and caught.value.node_ip
    assert _all_cpus_free()


def _start_a_ray_task():
    import ray

    from ray.util.placement_group import get_current_placement_group

    @ray.remote(num_cpus=1)
    def child():
        return "child ran"

    # A task the user's function starts (Ray Data, a helper task) needs a CPU; the trial's
    # placement group has none left, the rest of the cluster has.
    return get_current_placement_group().id.hex(), ray.get(child.remote(), timeout=30)


@needs_ray
@pytest.mark.timeout(180)
def test_tasks_started_by_workers_in_a_trial_placement_group_are_not_captured(cluster):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # A Ray Tune trial: a task in a placement group that captures its child tasks drives an
    # executor, whose workers go into that group (use_current_placement_group). As in
    # Horovod, the workers must not capture their own child tasks: they inherited the
    # trial's capture, so a task started in the user's function waited for room in the full
    # group and timed out, though the cluster had free CPUs.
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)

    @ray.remote(num_cpus=0)
    def trial():
        from horovod.ray import RayExecutor
        ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
        ex.start()
        try:
            return ex.run(_start_a_ray_task)
        finally:
            ex.shutdown()

    try:
        out = ray.get(trial.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_capture_child_tasks=True)).remote(), timeout=150)
    finally:
        remove_placement_group(pg)
    assert out == [(pg.id.hex(), "child ran")] * 2, out
    assert _all_cpus_free()


def _interface_vars():
    import collective as hvd
    hvd.init()  # the job forms over the named interface
    return [os.environ.get("HOROVOD_GLOO_IFACE"), os.environ.get("NCCL_SOCKET_IFNAME")]


def _elastic_interface_vars():
    import collective as hvd
    from collective import elastic
    hvd.init()
    return elastic.run(lambda state: _interface_vars())(elastic.ObjectState(epoch=0))


@needs_ray
@pytest.mark.timeout(240)
def test_nics_name_the_interface_for_gloo_and_nccl(cluster):
    from horovod.ray import RayExecutor

    # As in Horovod (and hvdrun --network-interface), `nics` also pins NCCL's sockets
    # (NCCL_SOCKET_IFNAME): only HOROVOD_GLOO_IFACE was set, so GPU jobs let NCCL pick an
    # interface of its own. A value given in extra_env_vars wins.
    settings = RayExecutor.create_settings(timeout_s=60, nics={"lo"})
    ex = RayExecutor(settings, num_workers=2)
    ex.start()
    try:
        assert ex.run(_interface_vars) == [["lo", "lo"]] * 2
    finally:
        ex.shutdown()
    ex.start(extra_env_vars={"NCCL_SOCKET_IFNAME": "=eth0"})
    try:
        assert ex.run(_interface_vars) == [["lo", "=eth0"]] * 2
    finally:
        ex.shutdown()
    elastic = RayExecutor(settings, min_workers=2, max_workers=2, cpus_per_worker=1,
                          elastic_timeout=60)
    elastic.start()
    try:
        assert elastic.run(_elastic_interface_vars) == [["lo", "lo"]] * 2
    finally:
        elastic.shutdown()
    assert _all_cpus_free()


class _FakeWorkerGroup:
    """What the HorovodTrainer backend uses of Ray Train's worker group."""

    def __init__(self, nodes):
        self.nodes, self.envs = nodes, {}

    def execute(self, fn):
        return list(self.nodes)

    def execute_single_async(self, rank, fn, env):
        import ray
        self.envs[rank] = dict(env)
        return ray.put(None)


@needs_ray
@pytest.mark.timeout(120)
def test_horovod_config_nics_name_the_interface_for_gloo_and_nccl(cluster):
    from horovod.ray import HorovodConfig
    config = HorovodConfig(nics={"lo"}, timeout_s=60)
    backend = config.backend_cls()
    group = _FakeWorkerGroup(["node-a", "node-a"])
    backend.on_start(group, config)
    backend.on_shutdown(group, config)
    assert [(e["HOROVOD_GLOO_IFACE"], e["NCCL_SOCKET_IFNAME"], e["HOROVOD_LOCAL_RANK"])
            for _, e in sorted(group.envs.items())] == [("lo", "lo", "0"), ("lo", "lo", "1")]


@needs_ray
@pytest.mark.timeout(180)
def test_shutdown_after_ray_shutdown_starts_no_new_ray_instance():
    # `ray.shutdown()` before `executor.shutdown()` (a finally block, a fixture's teardown):
    # the actors went with the driver's job; ray.kill() would start a new local Ray instance.
    code = ("import json, ray\n"
            "from horovod.ray import RayExecutor\n"
            "ray.init(address='local', num_cpus=1, include_dashboard=False, "
            "log_to_driver=False)\n"
            "ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=1)\n"
            "ex.start()\n"
            "ran = ex.run(lambda: 1)\n"
            "ray.shutdown()\n"
            "ex.shutdown()\n"
            "print(json.dumps([ran, ray.is_initialized()]))\n"
            "ray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env.setdefault("RAY_worker_niceness", "0")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran, initialized = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ran == [1]
    assert initialized is False, "executor.shutdown() started a new Ray instance"


@needs_ray
@pytest.mark.timeout(60)
def test_executor_argument_errors(cluster):
    from horovod.ray import ElasticRayExecutor, RayExecutor
    s = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="num_workers or num_hosts"):
        RayExecutor(s)
    with pytest.raises(ValueError, match="use_gpu must be True"):
        RayExecutor(s, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(s, max_workers=2)
    with pytest.raises(ValueError, match="mutually exclusive"):
        RayExecutor(s, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="below min_workers"):
        RayExecutor(s, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="must be a positive integer"):
        RayExecutor(s, num_workers=True)
    # NumPy integers (a config or a Tune search space) are integers; they were refused with
    # "num_workers=np.int64(2) must be a positive integer", and min_workers as num_workers.
    import numpy as np
    assert RayExecutor(s, num_workers=np.int64(2)).num_workers == 2
    assert RayExecutor(s, num_hosts=np.int32(2), num_workers_per_host=np.int64(2)).num_workers == 4
    assert RayExecutor(s, min_workers=np.int64(1), max_workers=np.int64(2)).num_workers == 1
    with pytest.raises(ValueError, match="min_workers=1.5 must be a positive integer"):
        RayExecutor(s, min_workers=1.5)
    with pytest.raises(ValueError, match="max_workers=2.5 must be a positive integer"):
        RayExecutor(s, min_workers=1, max_workers=2.5)
    with pytest.raises(ValueError, match="reserve nothing"):
        RayExecutor(s, num_workers=1, cpus_per_worker=0)
    with pytest.raises(ValueError, match="reserve nothing"):  # elastic too (2**30 slots a node)
        RayExecutor(s, min_workers=1, cpus_per_worker=0)
    # create_settings' cooldown_range reaches the job (it was ignored: failed nodes for good)
    cool = ElasticRayExecutor.create_settings(min_num_proc=1, cooldown_range=(10, 60))
    assert cool.cooldown_range == (10, 60)
    with pytest.warns(DeprecationWarning):
        assert ElasticRayExecutor(cool)._executor._elastic["cooldown_range"] == (10.0, 60.0)
    elastic = RayExecutor(s, min_workers=1, max_workers=2)
    with pytest.raises(NotImplementedError, match="run\\(\\) only"):
        elastic.execute(lambda w: 1)
    with pytest.warns(DeprecationWarning, match="RayExecutor"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(min_num_proc=1))
    # Horovod's deprecated spellings warn (they were taken silently), and the elastic
    # executor's errors name its own arguments (gpus_per_slot, not gpus_per_worker).
    with pytest.warns(DeprecationWarning, match="min_np is deprecated, use min_num_proc"):
        es = ElasticRayExecutor.create_settings(min_np=2)
    with pytest.warns(DeprecationWarning, match="max_np is deprecated, use max_num_proc"):
        es = ElasticRayExecutor.create_settings(min_num_proc=2, max_np=3)
    assert (es.min_np, es.max_np) == (2, 3)
    with pytest.raises(ValueError, match="gpus_per_slot is set, but use_gpu is False"):
        ElasticRayExecutor(es, gpus_per_slot=1)
    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=64)
    with pytest.raises(TimeoutError, match="Placement group"):
        ex.start()
    assert _all_cpus_free()


def test_plan_matches_hvdrun_slot_assignment():
    if not HAVE_RAY:
        skip_or_fail('Ray is not installed (pip install ".[ray]")', "ray")
    from launcher.hosts import HostInfo, get_host_assignments
    from launcher.ray.plan import group_by_node, rank_env, slots_for_nodes
    nodes = ["a", "b", "a", "c", "b", "a"]
    order = group_by_node(nodes)
    assert [nodes[i] for i in order] == ["a", "a", "a", "b", "b", "c"]
    grouped = [nodes[i] for i in order]
    assert slots_for_nodes(grouped) == get_host_assignments(
        [HostInfo("a", 3), HostInfo("b", 2), HostInfo("c", 1)], 6)
    ungrouped = slots_for_nodes(["a", "b", "a"])
    assert [(s.local_rank, s.cross_rank, s.cross_size) for s in ungrouped] == [
        (0, 0, 2), (0, 1, 2), (1, 0, 1)]
    env = rank_env(ungrouped[2], ("10.0.0.1", 5000), "ab", {"X": 1})
    assert env["HOROVOD_RANK"] == "2" and env["HOROVOD_HOSTNAME"] == "a"
    assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_SECRET_KEY"] == "ab"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1" and env["X"] == "1"


def test_visible_gpus_lists_each_gpu_of_a_node_once():
    if not HAVE_RAY:
        skip_or_fail('Ray is not installed (pip install ".[ray]")', "ray")
    from launcher.ray.plan import visible_gpus
    # One GPU per worker: local-rank order, so GPU `local_rank` of the list is the worker's own.
    assert visible_gpus(["a", "a", "b", "b"], [[1], [0], [0], [1]]) == ["1,0", "1,0", "0,1", "0,1"]
    # Half a GPU each: workers that share a GPU got the same id, listed once ("0,0,1" before).
    assert visible_gpus(["a", "a", "a"], [[0], [0], [1]]) == ["0,1"] * 3
    assert visible_gpus(["a", "b", "a"], [["0"], [0], [0]]) == ["0", "0", "0"]  # str or int
    # Several GPUs per worker: each worker's ids in numeric order, not text order.
    assert visible_gpus(["a", "a"], [[10, 2], ["3", 2]]) == ["2,10,3"] * 2
    assert visible_gpus(["a"], [["GPU-b", "GPU-a"]]) == ["GPU-a,GPU-b"]  # UUIDs as text
    assert visible_gpus(["a"], [[]]) == [""]
    with pytest.raises(ValueError):
        visible_gpus(["a", "b"], [[0]])


@needs_ray
@pytest.mark.timeout(120)
def test_use_gpu_with_fractional_gpus_lists_each_gpu_once():
    # Ray hands out GPU ids without GPUs: a local instance with two fake ones. Three workers of
    # half a GPU on two GPUs: two of them share one, whose id the executor listed twice ("0,0,1").
    code = ("import json, os, ray\n"
            "from horovod.ray import RayExecutor\n"
            "ray.init(address='local', num_cpus=2, num_gpus=2, include_dashboard=False, "
            "log_to_driver=False)\n"
            "out = {}\n"
            "for n, g in ((3, 0.5), (2, 1)):\n"
            "    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=n,\n"
            "                     cpus_per_worker=0.5, use_gpu=True, gpus_per_worker=g)\n"
            "    ex.start()\n"
            "    try:\n"
            "        out[str(g)] = ex.run(lambda: [int(os.environ['HOROVOD_LOCAL_RANK']),\n"
            "                                      os.environ['CUDA_VISIBLE_DEVICES'],\n"
            "                                      [str(i) for i in ray.get_gpu_ids()]])\n"
            "    finally:\n"
            "        ex.shutdown()\n"
            "print(json.dumps(out))\n"
            "ray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env.setdefault("RAY_worker_niceness", "0")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    half = out["0.5"]
    given = [ids[0] for _, _, ids in half]  # the GPU Ray gave each worker
    assert all(len(ids) == 1 for _, _, ids in half) and len(set(given)) < 3, half
    visible = {v for _, v, _ in half}
    assert len(visible) == 1, half  # the same list on every worker of the node
    listed = visible.pop().split(",")
    assert len(listed) == len(set(listed)) and set(listed) == set(given), half
    assert listed == sorted(set(given), key=given.index), half  # local-rank order
    for local_rank, v, ids in out["1"]:  # one GPU each: GPU `local_rank` is the worker's own
        assert v.split(",")[local_rank] == ids[0], out["1"]


def _train_loop(config):
    import tempfile as tf

    import torch

    import horovod.torch as hvd
    import ray.train
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=config["lr"]),
                                   named_parameters=model.named_parameters())
    for epoch in range(2):
        x = torch.randn(16, 4)
        loss = ((model(x) - 1.0) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        w = hvd.allgather(torch.cat([p.detach().flatten() for p in model.parameters()])[None])
        checkpoint = None
        if hvd.rank() == 0:
            d = tf.mkdtemp()
            torch.save(model.state_dict(), os.path.join(d, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"epoch": epoch, "size": hvd.size(), "rank": hvd.rank(),
                          "same_weights": bool((w == w[0]).all()),
                          "local_rank": hvd.local_rank()}, checkpoint=checkpoint)


def _fit(trainer_cls, name, **kw):
    from ray.train import RunConfig, ScalingConfig
    trainer = trainer_cls(_train_loop, train_loop_config={"lr": 0.1},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path=tempfile.mkdtemp(), name=name), **kw)
    return trainer.fit()


@needs_ray
@pytest.mark.timeout(480)
def test_ray_train_horovod_trainer_reports_and_checkpoints(cluster):
    from horovod.ray import HorovodConfig, HorovodTrainer
    result = _fit(HorovodTrainer, "hvd", horovod_config=HorovodConfig(timeout_s=60))
    assert result.error is None
    assert result.metrics["epoch"] == 1 and result.metrics["size"] == 2
    assert result.metrics["same_weights"] is True
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        assert os.path.exists(os.path.join(d, "model.pt"))


@needs_ray
@pytest.mark.timeout(480)
def test_torch_trainer_with_hvd_init_inside(cluster):
    from ray.train.torch import TorchTrainer
    result = _fit(TorchTrainer, "torch")
    assert result.error is None
    assert result.metrics["epoch"] == 1 and result.metrics["size"] == 2
    assert result.metrics["same_weights"] is True
    assert result.checkpoint is not None


# -- elastic (last: it removes a node of the module's cluster and adds another) ---------------

def _elastic_train(progress_dir, epochs_min):
    import torch

    import horovod.torch as hvd
    hvd.init()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, sizes=[])

    @hvd.elastic.run
    def loop(state):
        while True:
            if hvd.size() not in state.sizes[-1:]:
                state.sizes.append(hvd.size())
            x = torch.randn(8, 4)
            loss = (model(x) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.epoch += 1
            if hvd.rank() == 0:
                with open(os.path.join(progress_dir, "progress"), "w") as f:
                    json.dump({"epoch": state.epoch, "size": hvd.size(), "sizes": state.sizes}, f)
            time.sleep(0.2)
            state.commit()
            done = os.path.exists(os.path.join(progress_dir, "finish"))
            if state.epoch >= epochs_min and done:
                return {"epoch": state.epoch, "sizes": list(state.sizes), "rank": hvd.rank(),
                        "size": hvd.size(),
                        "weights": [p.detach().flatten().tolist() for p in model.parameters()]}

    return loop(state)


def _progress(d):
    try:
        with open(os.path.join(d, "progress")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _wait_for(pred, what, timeout=240):
    # Generous: on a loaded 2-core machine Ray's workers (which Ray runs at a lower priority)
    # can take minutes to import torch and start training. A passing run returns at once.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@needs_ray
@pytest.mark.timeout(900)
def test_elastic_node_leaves_then_joins(cluster):
    import threading

    from horovod.ray import RayExecutor
    d = tempfile.mkdtemp()
    # One worker per node (2 CPUs each): the head node's worker survives, the other node leaves.
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=180), min_workers=1, max_workers=2,
                     cpus_per_worker=CPUS_PER_NODE, elastic_timeout=180)
    ex.start()
    out, err = [], []

    def run():
        try:
            out.append(ex.run(_elastic_train, args=(d, 10)))
        except BaseException as exc:  # noqa: BLE001
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        _wait_for(lambda: _progress(d).get("size") == 2 and _progress(d)["epoch"] >= 3 or err,
                  "2 workers training")
        assert not err, err
        before = _progress(d)["epoch"]
        cluster.remove_node(cluster.worker_node)
        _wait_for(lambda: _progress(d).get("size") == 1 or err, "the job to shrink to 1")
        assert not err, err
        assert _progress(d)["epoch"] >= before - 1  # restored from the last commit
        cluster.worker_node = cluster.add_node(num_cpus=CPUS_PER_NODE)
        _wait_for(lambda: _progress(d).get("size") == 2 and _progress(d)["sizes"][-2:] == [1, 2]
                  or err, "the new node's worker to join")
        open(os.path.join(d, "finish"), "w").close()
        t.join(120)
        assert not t.is_alive(), "the elastic job did not finish"
        assert not err, err
    finally:
        open(os.path.join(d, "finish"), "w").close()
        t.join(60)
        ex.shutdown()
    res = out[0]
    assert [r["rank"] for r in res] == [0, 1] and {r["size"] for r in res} == {2}
    assert res[0]["sizes"] == [2, 1, 2] and res[0]["epoch"] >= 10
    assert res[0]["weights"] == res[1]["weights"] and res[0]["epoch"] == res[1]["epoch"]
    assert _all_cpus_free()


def _elastic_raise_on_rank_1():
    import numpy as np

    import collective as hvd
    from collective import elastic
    hvd.init()
    state = elastic.ObjectState(epoch=0, sizes=[])

    @elastic.run
    def loop(state):
        state.sizes.append(hvd.size())
        for state.epoch in range(state.epoch, 4):
            if hvd.rank() == 1 and state.epoch == 1:
                raise ValueError("user error on rank 1")
            hvd.allreduce(np.ones(2), op=hvd.Sum, name="x")  # rank 0 waits here for rank 1
            state.commit()
        return {"rank": hvd.rank(), "size": hvd.size(), "sizes": state.sizes,
                "epoch": state.epoch}

    return loop(state)


@needs_ray
@pytest.mark.timeout(300)
def test_elastic_worker_raising_fails_its_peers_over_instead_of_hanging(cluster):
    import threading

    from horovod.ray import RayExecutor
    # One worker per node: rank 1 raises while rank 0 waits in an allreduce for it. Its actor
    # outlived the task, and its runtime kept rank 0 waiting forever; it must end as a process
    # would, so that rank 0 fails over and finishes alone (rank 1's node is blacklisted).
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), min_workers=1, max_workers=2,
                     cpus_per_worker=CPUS_PER_NODE, elastic_timeout=60)
    ex.start()
    out, err = [], []

    def run():
        try:
            out.append(ex.run(_elastic_raise_on_rank_1))
        except BaseException as exc:  # noqa: BLE001
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(150)
    ex.shutdown()
    assert not t.is_alive(), "the survivor hung in its allreduce with the failed worker"
    assert not err, err
    assert out[0] == [{"rank": 0, "size": 1, "sizes": [2, 1], "epoch": 3}], out
    assert _all_cpus_free()


@needs_ray
@pytest.mark.timeout(300)
def test_failed_elastic_job_carries_what_the_worker_raised(cluster):
    from horovod.ray import RayExecutor
    # min_workers=2 with one worker per node: once rank 1 raises, its node is blacklisted and
    # the job cannot re-form; the error must carry rank 1's exception and traceback, not just
    # "timed out waiting for slots".
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), min_workers=2, max_workers=2,
                     cpus_per_worker=CPUS_PER_NODE, elastic_timeout=5)
    ex.start()
    try:
        with pytest.raises(RuntimeError, match="elastic job failed") as err:
            ex.run(_elastic_raise_on_rank_1)
    finally:
        ex.shutdown()
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "ValueError" in notes and "user error on rank 1" in notes, notes
    assert "_elastic_raise_on_rank_1" in notes, notes  # the traceback
    assert _all_cpus_free()


def _elastic_rank_1_raises_at_the_end(when, marker):
    import numpy as np

    import collective as hvd
    from collective import elastic
    hvd.init()
    state = elastic.ObjectState(epoch=0)

    @elastic.run
    def loop(state):
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="last")  # the job's last collective
        return hvd.rank()

    rank = loop(state)
    deadline = time.monotonic() + 60
    if rank == 0:
        if when == "while rank 0 finishes":  # returns after the driver has heard of rank 1
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(2)
        else:
            open(marker, "w").close()
        return {"rank": 0}
    if when == "while rank 0 finishes":
        open(marker, "w").close()
    else:  # raises once rank 0 has returned
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    raise ValueError("rank 1 raises at the end")


@needs_ray
@pytest.mark.timeout(300)
def test_elastic_worker_raising_in_the_last_round_fails_the_job(cluster):
    from horovod.ray import RayExecutor
    # One worker per node, min_workers=2: rank 1 raises after the last collective, while or
    # after rank 0 returns. Nothing is left for rank 0 to fail, so no new round forms: the job
    # failed, and run() must not return rank 0's result alone (it did when the driver heard of
    # rank 1's exception before rank 0's return).
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), min_workers=2, max_workers=2,
                     cpus_per_worker=CPUS_PER_NODE, elastic_timeout=5)
    ex.start()
    try:
        for when in ("while rank 0 finishes", "after rank 0 returned"):
            marker = os.path.join(tempfile.mkdtemp(), "marker")
            with pytest.raises(RuntimeError, match="elastic job failed") as err:
                ex.run(_elastic_rank_1_raises_at_the_end, args=(when, marker))
            assert "worker 1 (rank 1 on host " in str(err.value), (when, str(err.value))
            assert "failed in the last round" in str(err.value), (when, str(err.value))
            notes = "\n".join(getattr(err.value, "__notes__", []))
            assert "ValueError" in notes and "rank 1 raises at the end" in notes, (when, notes)
            assert "_elastic_rank_1_raises_at_the_end" in notes, (when, notes)  # traceback
    finally:
        ex.shutdown()
    assert _all_cpus_free()


def _elastic_wait_forever(marker_dir):
    import numpy as np

    import collective as hvd
    from collective import elastic
    hvd.init()
    state = elastic.ObjectState(epoch=0)

    @elastic.run
    def loop(state):
        hvd.allreduce(np.ones(2), op=hvd.Sum, name="x")
        open(os.path.join(marker_dir, f"started.{hvd.rank()}"), "w").close()
        time.sleep(600)

    return loop(state)


@needs_ray
@pytest.mark.timeout(300)
def test_elastic_workers_the_driver_ended_are_not_reported_lost(cluster):
    import signal
    import threading

    from horovod.ray import RayExecutor
    # SIGINT stops the job: the driver ends both (running) workers' actors. The notes must
    # say so once per worker ("worker 0: ... ended by the elastic driver"), not call them lost
    # with Ray's "died unexpectedly" and the worker id twice.
    d = tempfile.mkdtemp()
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), min_workers=2, max_workers=2,
                     cpus_per_worker=CPUS_PER_NODE, elastic_timeout=5)
    ex.start()
    started = [os.path.join(d, f"started.{r}") for r in (0, 1)]
    stop = threading.Event()

    def interrupt():  # run() handles SIGINT once its workers run (its driver's handler is in)
        while not stop.wait(0.1):
            if all(os.path.exists(p) for p in started):
                os.kill(os.getpid(), signal.SIGINT)
                return

    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    try:
        with pytest.raises(RuntimeError, match="received SIGINT") as err:
            ex.run(_elastic_wait_forever, args=(d,))
    finally:
        stop.set()
        t.join(5)
        ex.shutdown()
    notes = getattr(err.value, "__notes__", [])
    assert len(notes) == 2, notes
    for wid, note in enumerate(notes):
        assert note.startswith(f"ringvod on Ray: worker {wid}: its actor on Ray node "), note
        assert note.endswith(" was ended by the elastic driver"), note
        assert note.count(f"worker {wid}") == 1 and "lost" not in note, note
    assert _all_cpus_free()
