"""gRPC server reflection on every Tandem server, as ``grpc.reflection.v1`` and ``v1alpha``.

Owns enabling reflection on a grpc.aio server under both names. grpcurl, Postman and other
clients ask ``grpc.reflection.v1.ServerReflection`` first and fall back to ``v1alpha`` only on
UNIMPLEMENTED; the Python ``grpcio-reflection`` package serves ``v1alpha`` alone. The two
protocols are the same messages under another package name, byte for byte on the wire, so
``v1`` is the package's own servicer behind a second method name. The ``v1`` service's file
descriptor is derived from ``v1alpha``'s (package renamed) and added to the default
descriptor pool when a server enables reflection, so that a client can describe the
reflection service itself, as it can any other. It does not own the services listed.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
V1_PACKAGE = "grpc.reflection.v1"
V1ALPHA_SERVICE_NAME = f"{V1ALPHA_PACKAGE}.ServerReflection"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE_NAME = "grpc/reflection/v1/reflection.proto"
_METHOD = "ServerReflectionInfo"


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection (v1 and v1alpha) on ``server``, listing ``service_names`` and the
    reflection services themselves."""
    register_v1_descriptor()
    names = tuple(dict.fromkeys((*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)))
    servicer = ReflectionServicer(names)
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        _METHOD: grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString),
    }),))


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to ``pool`` (default: the default pool)
    unless a file there already defines the v1 service (a later grpcio-reflection may)."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return
    except KeyError:
        pass
    pool.Add(v1_file_descriptor())


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """``v1alpha``'s file descriptor with its package (and every type reference) renamed."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE_NAME, V1_PACKAGE
    proto.options.Clear()  # language package options name v1alpha's packages
    old, new = f".{V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    return proto
