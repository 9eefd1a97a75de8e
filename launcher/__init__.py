"""ringvod's launcher: `hvdrun`, host parsing and slot assignment, worker environments, local and
ssh process spawning, `mpirun` command building, and `horovod.run` (see launcher/api.py).

Importable with the standard library alone; imports nothing heavy at import time.
"""

__all__: list[str] = []
