"""A client that contributes memory: a KVClient whose process also serves a segment.

    from kvpool.embedded import ContributingClient
    with ContributingClient("127.0.0.1:50051", host_bytes=1 << 30) as kv:
        kv.put("k", b"v")     # may land in this process's own segment, or anywhere else

This is what a Mooncake client with ``global_segment_size > 0`` does. It composes a client and
a store node, so it sits above both (client/ and store_node/ never import each other).
"""

from kvpool.embedded.client import ContributingClient, EmbeddedSegment

__all__ = ["ContributingClient", "EmbeddedSegment"]
