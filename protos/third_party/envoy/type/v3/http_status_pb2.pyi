from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    Empty: _ClassVar[StatusCode]
    OK: _ClassVar[StatusCode]
    BadRequest: _ClassVar[StatusCode]
    NotFound: _ClassVar[StatusCode]
    TooManyRequests: _ClassVar[StatusCode]
    InternalServerError: _ClassVar[StatusCode]
    ServiceUnavailable: _ClassVar[StatusCode]
    GatewayTimeout: _ClassVar[StatusCode]
Empty: StatusCode
OK: StatusCode
BadRequest: StatusCode
NotFound: StatusCode
TooManyRequests: StatusCode
InternalServerError: StatusCode
ServiceUnavailable: StatusCode
GatewayTimeout: StatusCode

class HttpStatus(_message.Message):
    __slots__ = ("code",)
    CODE_FIELD_NUMBER: _ClassVar[int]
    code: StatusCode
    def __init__(self, code: _Optional[_Union[StatusCode, str]] = ...) -> None: ...
