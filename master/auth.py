"""What each role may call on the master (SECURITY.md), checked on the gRPC port by an
interceptor and on the lookup port by master/lookup_server.py, with one table.

- node RPCs (MountSegment, UnmountSegment, Heartbeat, AnnounceObjects, WatchManifest,
  AckManifest): store nodes only, each only as itself (the request's node id is the one its
  certificate names);
- a ReportCorrupt naming a node (its own re-check, which drops the replicas): that node only
  (master/rechecks.py); a reader's (no node) only asks the node to re-check;
- admin RPCs: ``Stats`` with ``audit`` (it walks every indexed object) for admins only;
- everything else (puts, gets, removes, pins, ReportCorrupt, Stats, the Router service):
  clients and admins; a GetReplicas of no keys (how a peer learns the lookup port) and an
  OpenLookupSession (its session there, which acts as the peer) anyone authenticated. A store
  node is not a client: its certificate lets it serve its own segments, not read or write the
  cache through the master.

The peer's identity comes from its verified certificate (common/security.py); a master
serving without credentials (loopback, or ``--insecure``) checks nothing.

Where a call is checked, a client's keys are also put in its tenant's namespace
(:func:`scope`, common/tenants.py) before the handler sees them, and a PutStart answer names
the tenant (its writer hands its nodes records of the stored keys). Admins are not scoped: they
name stored keys, any tenant's.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import grpc
from kvpool.common import tenants
from kvpool.common.errors import InvalidArgument
from kvpool.common.logging import RateLimited, get_logger
from kvpool.common.security import Identity, Tokens, identity_from_pem
from kvpool.master.request_guard import relay

log = get_logger(__name__)

NODE_METHODS = frozenset({"MountSegment", "UnmountSegment", "Heartbeat", "AnnounceObjects",
                          "WatchManifest", "AckManifest"})
CLIENT_ROLES = frozenset({"client", "admin"})
# The calls whose request names keys (``keys``; PutStart's ``parents`` too).
KEYED_METHODS = frozenset({"PutStart", "PutEnd", "PutRevoke", "GetReplicas", "Exists",
                           "Remove", "Pin", "ReportCorrupt"})


class Refused(Exception):
    """A call this identity may not make: ``code`` is PERMISSION_DENIED or UNAUTHENTICATED."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _node_of(method: str, request) -> str | None:
    """The node a node RPC acts for (None: the request is malformed; its guard answers)."""
    if method == "MountSegment":
        node = getattr(request, "node", None)
        return getattr(node, "node_id", None)
    return getattr(request, "node_id", None)


def check(method: str, identity: Identity | None, request=None) -> None:
    """Refused unless ``identity`` may call ``method`` (a gRPC method's short name) with
    ``request`` (None: the role alone, for a stream whose requests come later)."""
    if identity is None:
        raise Refused(grpc.StatusCode.UNAUTHENTICATED,
                      f"{method}: no verified client certificate (see SECURITY.md)")
    if method in NODE_METHODS or (method == "ReportCorrupt" and getattr(request, "node_id", "")):
        if identity.role != "node":
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method} is for store nodes; the caller is {identity}")
        node = _node_of(method, request) if request is not None else identity.name
        if node is not None and node != identity.name:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method} for node {node!r} from {identity}: a node acts only as "
                          f"itself")
        return
    if method == "OpenLookupSession" or (method == "GetReplicas" and request is not None
                                         and not getattr(request, "keys", True)):
        return   # any peer (a store node too): its lookup-port session; the port's number
    if identity.role not in CLIENT_ROLES:
        raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                      f"{method} is for clients; the caller is {identity}")
    if method == "Stats" and getattr(request, "audit", False) and identity.role != "admin":
        raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                      f"Stats with audit is for admins; the caller is {identity}")


# The checked caller of the call being served (gRPC: set by the Authorizer for its handler).
CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvpool_caller",
                                                                         default=None)


def caller_tenant() -> str:
    """:func:`tenant` of the caller of the gRPC call being served."""
    return tenant(CALLER.get())


def tenant(identity: Identity | None) -> str:
    """The namespace a caller's keys live in: a client's tenant (its name); "" (keys as given)
    for any other role, and where nothing is checked."""
    return identity.name if identity is not None and identity.role == "client" else ""


def scope(method: str, identity: Identity | None, request) -> None:
    """Put the keys of a checked ``request`` in the caller's tenant's namespace, in place (a
    Route: name the tenant, whose objects its store tier looks among). A node's own
    ReportCorrupt names stored keys, and is not a client's."""
    name = tenant(identity)
    if not name or not (method in KEYED_METHODS and hasattr(request, "keys")
                        or method == "Route" and hasattr(request, "tenant")):
        return   # (not a keyed call, or a malformed request, which its guard answers)
    try:
        tenants.check_tenant(name)
    except InvalidArgument as e:
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{method} from {identity}: {e}"
                      ) from None
    if method == "Route":   # its store tier looks among the tenant's own objects
        request.tenant = name
        return
    _rescope(request.keys, tenants.scoped_all(name, request.keys))
    if method == "PutEnd" and request.as_keys:   # the keys its slots are filled with
        _rescope(request.as_keys, tenants.scoped_all(name, request.as_keys))
    if method in ("PutStart", "PutEnd") and request.parents \
            and tenants.scoped_all(name, request.parents) is not None:
        _rescope(request.parents, [tenants.scoped(name, p) if p else "" for p in request.parents])


_MARK_BYTE = tenants.MARK.encode()


def scope_frame(method: str, identity: Identity | None, request, body: bytes) -> None:
    """:func:`scope` for a ``request`` that came serialized as ``body`` (the lookup port): the
    default tenant's keys stay as they are unless one holds the namespace mark, and a body
    without the mark's byte anywhere holds no such key, so it is not looked at key by key."""
    if method in KEYED_METHODS and tenant(identity) == tenants.DEFAULT \
            and _MARK_BYTE not in body:
        return
    scope(method, identity, request)


def _rescope(field, keys: list[str] | None) -> None:
    """A repeated field's keys replaced by ``keys`` (None: they stay as they are)."""
    if keys is not None:
        del field[:]
        field.extend(keys)


def scope_answer(method: str, identity: Identity | None, response) -> None:
    """A PutStart answer names the tenant whose namespace its keys were put in, a GetReplicas
    answer the one they are looked up in; a client's Stats tell of its own tenant only."""
    name = tenant(identity)
    if not name:
        return
    if method in ("PutStart", "GetReplicas"):
        response.tenant = name
    elif method == "Stats":
        own = [t for t in response.tenants if t.tenant == name]
        del response.tenants[:]
        response.tenants.extend(own)


def grpc_identity(context, tokens: Tokens | None = None) -> Identity | None:
    """The identity a gRPC call's verified peer certificate names, else (on the token port,
    which requests no certificate) the one its bearer token is bound to, if any."""
    certs = context.auth_context().get("x509_pem_cert")
    if not certs:
        if tokens is None:
            return None
        metadata = context.invocation_metadata() or ()
        return tokens.identify(next((v for k, v in metadata if k == "authorization"), None))
    try:
        return identity_from_pem(certs[0])
    except ValueError:
        return None


class Authorizer(grpc.aio.ServerInterceptor):
    """Refuses every call :func:`check` refuses, before its handler runs. ``tokens``: the
    bearer tokens accepted from peers without a certificate (the token port)."""

    def __init__(self, limit: RateLimited | None = None, tokens: Tokens | None = None) -> None:
        self.limit = limit or RateLimited(log)
        self.tokens = tokens

    def _refuse(self, method: str, context, error: Refused) -> str:
        self.limit.warning("call_refused", kind=(method, str(error.code)), method=method,
                           peer=context.peer(), reason=str(error))
        return str(error)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method.rpartition("/")[2]
        refuse, tokens = self._refuse, self.tokens

        async def checked(request, context) -> Identity | None:
            identity = grpc_identity(context, tokens)
            CALLER.set(identity)   # this call's task: its handler reads it
            try:
                check(method, identity, request)
                if request is not None:
                    scope(method, identity, request)
            except Refused as e:
                await context.abort(e.code, refuse(method, context, e))
            return identity

        def wrap(kind: str, make: Callable):
            inner = getattr(handler, kind)
            streaming_in = handler.request_streaming

            if kind == "unary_unary" or kind == "stream_unary":
                async def call(request, context):
                    identity = await checked(None if streaming_in else request, context)
                    response = await inner(request, context)
                    if response is not None:
                        scope_answer(method, identity, response)
                    return response
            else:
                async def call(request, context):
                    await checked(None if streaming_in else request, context)
                    await relay(inner(request, context), context)
            return make(call, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)

        for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                           ("unary_stream", grpc.unary_stream_rpc_method_handler),
                           ("stream_unary", grpc.stream_unary_rpc_method_handler),
                           ("stream_stream", grpc.stream_stream_rpc_method_handler)):
            if getattr(handler, kind) is not None:
                return wrap(kind, make)
        return handler
