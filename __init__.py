"""kvpool: a cluster-wide KV-cache store for LLM serving.

Subpackages: ``kvpool.client`` (the SDK engines link), ``kvpool.master``, ``kvpool.store_node``,
``kvpool.common``, ``kvpool.protos`` (the wire contract) and ``kvpool.tools`` (the command line).
"""

__version__ = "0.1.0"
