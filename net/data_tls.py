"""TLS on the tcp data port (``kvpool store-node --data-tls``), both ends: the node's server
context and the client's, from the cluster's credentials (common/security.py).

Grants decide who may read and write which bytes (common/capabilities.py); TLS keeps the
bytes, grants and record tags from whoever can watch the network. The client checks that
the certificate its node presents is a node's of the cluster's CA; the node asks for the
client's certificate but serves without one too (a token client has none): what it may do
is still what its grants say. The shm hand-off stays on the host and RDMA's queue-pair
handshake is not wrapped: a client does not use RDMA with a node whose data port is TLS.
"""

from __future__ import annotations

import socket
import ssl

from kvpool.common.errors import InvalidArgument, TransportError
from kvpool.common.security import Credentials, identity_from_pem


def _context(protocol: int, credentials: Credentials) -> ssl.SSLContext:
    """TLS 1.3 only, peers' certificates checked against the cluster's CA."""
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cadata=credentials.ca_pem.decode())
    return context


def server_context(credentials: Credentials) -> ssl.SSLContext:
    """A node's: its certificate; a client's certificate checked if it sends one."""
    if not credentials.cert_file:
        raise InvalidArgument(f"{credentials.path}: --data-tls needs the node's certificate "
                              "and key")
    context = _context(ssl.PROTOCOL_TLS_SERVER, credentials)
    context.load_cert_chain(credentials.cert_file, credentials.key_file)
    context.verify_mode = ssl.CERT_OPTIONAL
    # No session tickets after the handshake: a client takes an idle pooled connection that
    # has bytes to read for one its node closed.
    context.num_tickets = 0
    return context


def client_context(credentials: Credentials) -> ssl.SSLContext:
    """A client's: nodes' certificates checked against the cluster's CA (not for a host name:
    nodes move between hosts and addresses; :func:`wrap` checks the role instead)."""
    context = _context(ssl.PROTOCOL_TLS_CLIENT, credentials)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    if credentials.cert_file:
        context.load_cert_chain(credentials.cert_file, credentials.key_file)
    return context


def wrap(sock: socket.socket, context: ssl.SSLContext, endpoint: str) -> ssl.SSLSocket:
    """``sock`` (connected to a node's data port) after the TLS handshake, the peer checked
    to hold a node's certificate; TransportError otherwise (``sock`` closed): a refused
    handshake, and one that timed out or was reset (OSError)."""
    try:
        wrapped = context.wrap_socket(sock)
        peer = wrapped.getpeercert(binary_form=True)
        role = identity_from_pem(ssl.DER_cert_to_PEM_cert(peer).encode()).role if peer else ""
    except (OSError, ValueError) as e:     # ssl.SSLError is an OSError
        sock.close()
        raise TransportError(f"tcp {endpoint}: TLS handshake failed: {e}") from None
    if role != "node":
        wrapped.close()
        raise TransportError(f"tcp {endpoint}: the data port presented a {role or 'no'} "
                             "certificate, not a node's")
    return wrapped
