"""The replicas behind the gateway as one engine: a ``GenerateFn`` over ``EngineProxy``.

Owns turning the front end's ``GenerationRequest`` into the internal ``Engine.Generate``
message and the proxied stream back into ``GenerationDelta``s, and a ``ProxyError`` into the
status the public servicer answers. The public ``tandem.v1.Generation`` servicer
(``services.frontend``) runs on it exactly as it runs on a replica's local engine. It does not
own routing or retries (``proxy``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from engine_common.generation_request import GenerationRequest
from gateway.proxy import EngineProxy, ProxyError
from protos.tandem.v1 import engine_pb2
from services.engine_api.messages import delta_from_response, sampling_params_to_pb
from services.frontend.engine_seam import CallContext, GenerationDelta
from services.frontend.errors import ServiceError


class ProxiedServiceError(ServiceError):
    """A ``ProxyError`` in the shape the public servicer turns into a status."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.code = error.code


class RemoteEngine:
    def __init__(self, proxy: EngineProxy) -> None:
        self.proxy = proxy

    async def generate(self, request_id: str, request: GenerationRequest,
                       call: CallContext) -> AsyncGenerator[GenerationDelta, None]:
        message = engine_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_params_to_pb(request.params),
            cache_salt=request.cache_salt or "",
            priority=request.priority,
            lora_name=request.lora_name or "",
            # The deltas carry token ids, as a local engine's do (return_token_ids needs them).
            output_options=engine_pb2.OutputOptions(return_token_ids=True),
        )
        responses = self.proxy.generate(message, call)
        async with aclosing(responses):
            try:
                async for response in responses:
                    yield delta_from_response(response)
            except ProxyError as error:
                raise ProxiedServiceError(error) from error
