"""Worker bootstrap of `horovod.run`: `python -m launcher.run_task <addr> <port>`.

Fetches the pickled `(func, args, kwargs)` from the launcher's rendezvous server, runs it and
puts the pickled result back under this rank. The key-value channel is authenticated with the
job secret (HOROVOD_SECRET_KEY, hex) in both directions, so the worker unpickles only what the
launcher stored and the launcher only what a job member stored.

An uncaught exception ends this process at once with exit code 1 after printing the traceback
(as `python -m mpi4py.run` aborts): the launcher then stops the whole job, so no other rank
waits forever in a collective.
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any

from collective.config import read_env
from collective.rendezvous import KVClient

__all__ = ["main", "FUNC_SCOPE", "FUNC_KEY", "RESULT_SCOPE", "dumps"]

FUNC_SCOPE, FUNC_KEY, RESULT_SCOPE = "runfunc", "func", "runfunc_result"


def dumps(obj: Any) -> bytes:
    """cloudpickle when available (lambdas, closures, functions of __main__), else pickle."""
    try:
        import cloudpickle  # noqa: PLC0415

        return bytes(cloudpickle.dumps(obj))
    except ImportError:
        return pickle.dumps(obj)


def _rank() -> int:
    cfg = read_env()  # read now: an elastic init() rewrites HOROVOD_RANK
    for r in (cfg.rank, cfg.ompi_rank, cfg.pmi_rank, cfg.pmix_rank):
        if r >= 0:
            return r
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the shipped function once; returns 0, or ends the process with 1 on an exception."""
    args = sys.argv[1:] if argv is None else argv
    cfg = read_env()
    if not args and cfg.rendezvous_addr:  # elastic workers: the address is in the environment
        args = [cfg.rendezvous_addr, str(cfg.rendezvous_port)]
    if len(args) != 2:
        sys.stderr.write("usage: python -m launcher.run_task <addr> <port>\n")
        return 2
    rank = _rank()
    secret = bytes.fromhex(cfg.secret_key) if cfg.secret_key else b""
    if not secret:  # the function arrives pickled: only from a store that proved the secret
        sys.stderr.write("horovod.run: HOROVOD_SECRET_KEY is not set; refusing to unpickle a "
                         "function from an unauthenticated store (start it with horovod.run, "
                         "which sets the secret)\n")
        return 2
    client = KVClient(args[0], int(args[1]), secret, timeout=max(cfg.start_timeout, 30.0))
    try:
        func, fargs, fkwargs = pickle.loads(client.get(FUNC_SCOPE, FUNC_KEY))
        result = func(*fargs, **(fkwargs or {}))
        rank = _rank()  # elastic jobs: the rank of the last round (init() updates it)
        client.put(RESULT_SCOPE, str(rank), dumps(result))
        client.close()
    except SystemExit as exc:  # elastic: the driver removed this worker or stopped the job
        if exc.code not in (None, 0):
            sys.stderr.write(f"{exc.code}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(0 if exc.code in (None, 0) else 1)
    except BaseException:  # noqa: BLE001 - any failure must end the job, KeyboardInterrupt too
        sys.stderr.write(f"horovod.run: rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
