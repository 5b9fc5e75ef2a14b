"""A stand-in for a vLLM engine's KV-event publisher, on vLLM's wire format (no vLLM needed).

Like vllm/distributed/kv_events.py's ZmqEventPublisher: multipart (topic, 8-byte big-endian
seq, msgpack KVEventBatch). It binds an XPUB socket (a PUB to its subscribers) so it can wait
for the first subscription instead of racing it, prints ``endpoint: ...``, publishes the
batches of the scenario below once subscribed, prints ``published: N`` and waits for stdin EOF.

Scenario (block size 16, tokens 0..63 = blocks 0-3 of the test's prompt; engine hashes are
vLLM-style opaque values): blocks 0-2 stored on GPU (old array encoding), block 3 stored on CPU
(new map encoding, an int hash), then another sequence stored and removed.
"""

import sys
import time

import msgpack
import zmq

BS = 16
TOKENS = list(range(64))


def main() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:*")
    print(f"endpoint: {pub.getsockopt(zmq.LAST_ENDPOINT).decode()}", flush=True)
    pub.recv()     # the subscription message: a subscriber is connected
    batches = [
        # vLLM < 0.11: array_like structs, tag first.
        [time.time(), [["BlockStored", [b"e0" * 16, b"e1" * 16, b"e2" * 16], None,
                        TOKENS[:48], BS, None, "GPU"]], 0],
        # vLLM >= 0.11: map structs with a "type" tag; int hashes (builtin hash mode).
        {"ts": time.time(), "data_parallel_rank": 0,
         "events": [{"type": "BlockStored", "block_hashes": [2**63 + 5],
                     "parent_block_hash": b"e2" * 16, "token_ids": TOKENS[48:64],
                     "block_size": BS, "lora_id": None, "medium": "CPU", "lora_name": None}]},
        [time.time(), [["BlockStored", [77], None, [9] * BS, BS, None, None],
                       ["BlockRemoved", [77], None]], 0],
    ]
    for seq, batch in enumerate(batches):
        pub.send_multipart((b"", seq.to_bytes(8, "big"), msgpack.packb(batch)))
    print(f"published: {len(batches)}", flush=True)
    sys.stdin.read()
    pub.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
