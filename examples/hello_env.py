"""Prints what `hvdrun` told this rank, one line per rank (no ringvod runtime needed).

    hvdrun -np 2 --tcp python examples/hello_env.py
"""
import os
import socket

NAMES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
         "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
         "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")

print(f"pid {os.getpid()} on {socket.gethostname()}: "
      + " ".join(f"{k}={os.environ[k]}" for k in NAMES if k in os.environ), flush=True)
