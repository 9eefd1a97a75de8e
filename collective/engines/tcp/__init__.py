"""The tcp mode: control plane and host data engine over authenticated sockets.

Modules, from the bottom up (each imports only those above it):

* `cma`: `process_vm_readv` through ctypes (cross-memory attach).
* `net`: `Fabric`, one rank's listeners, accept thread and authenticated connections.
* `link`: `Link`, one connection to a peer (framed messages, a sender thread for bulk data).
* `shm`: `ShmLink`, bulk data between ranks of one host through shared memory.
* `plane`: `TcpControlPlane` and `create_backend` (who is who, the rendezvous).
* `ring`: `TcpEngine` (ring algorithms over the plane's links) and `create_engine`.

The engine registry (`collective.engines`) names `plane.create_backend` and
`ring.create_engine`; importing this package imports none of them.
"""
