"""Both ends of kvpool's own wire protocols below gRPC: the store node's tcp data port and shm
hand-off (:mod:`.data_port`), the master's lookup port (:mod:`.lookup_port`), socket helpers
(:mod:`.sockets`) and the pyverbs glue with its probe (:mod:`.verbs`, :mod:`.rdma_probe`).
Used by the client's transports, the store node's data server and the master alike; imports
only ``kvpool.common``."""
