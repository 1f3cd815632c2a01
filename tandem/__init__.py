"""Tandem's Python SDK (``Client``, ``AsyncClient``, the records they return and the errors
they raise). The ``tandem`` command lives in ``deploy.cli``."""

from tandem.channel_security import TlsConfig
from tandem.client import AsyncClient, Client
from tandem.errors import (
    AuthenticationError,
    CancelledError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    TandemError,
    UnavailableError,
)
from tandem.request_builders import GenerationOptions
from tandem.responses import (
    FunctionCall,
    Response,
    ResponseEvent,
    ResponseItemPage,
    ResponseOptions,
    ResponseUsage,
)
from tandem.results import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    CompletionChunk,
    ModelInfo,
    PromptLogprob,
    TokenLogprob,
    ToolCall,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "CancelledError",
    "ChatChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Client",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "DeadlineExceededError",
    "FunctionCall",
    "GenerationOptions",
    "InvalidRequestError",
    "ModelInfo",
    "OverloadedError",
    "PromptLogprob",
    "Response",
    "ResponseEvent",
    "ResponseItemPage",
    "ResponseOptions",
    "ResponseUsage",
    "TandemError",
    "TlsConfig",
    "TokenLogprob",
    "ToolCall",
    "UnavailableError",
    "Usage",
]
