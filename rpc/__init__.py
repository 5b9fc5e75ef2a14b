"""The client side of the master's gRPC services, shared by the client SDK and store nodes:
channels with deadlines, retry and leader finding (:mod:`.grpc_client`, :mod:`.leader`), the
lookup-port channel (:mod:`.lookup`), :class:`.master_client.MasterClient`, and protobuf <->
domain conversion for both services (:mod:`.wire`, :mod:`.routing_wire`, :mod:`.located`)."""
