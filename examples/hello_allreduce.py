"""Smallest ringvod job: every rank contributes its rank; everyone prints the sum.

    hvdrun -np 2 python examples/hello_allreduce.py          # MPI if installed, else tcp
    hvdrun -np 4 --tcp python examples/hello_allreduce.py
"""
import numpy as np

import collective as hvd


def main() -> None:
    hvd.init()
    total = hvd.allreduce(np.array([float(hvd.rank())]), op=hvd.Sum)
    expected = hvd.size() * (hvd.size() - 1) / 2
    assert total[0] == expected, (total, expected)
    print(f"rank {hvd.rank()}/{hvd.size()} (local {hvd.local_rank()}/{hvd.local_size()}, "
          f"mode {hvd.mode()}): allreduce sum = {total[0]:g}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
