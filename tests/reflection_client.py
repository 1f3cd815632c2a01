"""A gRPC server-reflection client for tests, speaking ``grpc.reflection.v1`` or ``v1alpha``.

``reflect`` asks a server, in one ``ServerReflectionInfo`` stream on the method path of the
protocol version given (what grpcurl and Postman call: v1 first), for its services and the
file descriptors that define some symbols. The messages are grpcio-reflection's ``v1alpha``
classes: the two versions' messages are identical on the wire (the Python package has no
``v1`` stubs), so a v1 answer that parses here is what a v1 client reads. The descriptors come
back parsed, with the transitive dependencies the server sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

VERSIONS = ("v1", "v1alpha")


@dataclass
class Reflection:
    services: list[str]
    # Per symbol asked for: the files the server sent (the defining file first), or the
    # error it answered.
    files: dict[str, list[descriptor_pb2.FileDescriptorProto]]
    errors: dict[str, tuple[int, str]]


def reflect(channel: grpc.Channel, version: str, symbols: Sequence[str] = (),
            timeout: float = 10.0) -> Reflection:
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    requests = [reflection_pb2.ServerReflectionRequest(list_services="")] + [
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in symbols]
    replies = list(call(iter(requests), timeout=timeout))
    assert len(replies) == len(requests), replies
    result = Reflection([s.name for s in replies[0].list_services_response.service], {}, {})
    for symbol, reply in zip(symbols, replies[1:], strict=True):
        if reply.HasField("error_response"):
            error = reply.error_response
            result.errors[symbol] = (error.error_code, error.error_message)
            continue
        result.files[symbol] = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                                for raw in reply.file_descriptor_response.file_descriptor_proto]
    return result


def defines_service(file: descriptor_pb2.FileDescriptorProto, full_name: str) -> bool:
    package, _, name = full_name.rpartition(".")
    return file.package == package and name in [s.name for s in file.service]
