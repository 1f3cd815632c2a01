"""Replays a model's text through the chat API's response folding, streamed and not.

``chunks_and_response`` feeds a text, cut into pieces of one size, to ``chat_chunks`` and to
``chat_response`` as one choice's engine deltas ending with "stop", so a test can check that
the stream says what the response says for the tools and reasoning plans it gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.chat.response import chat_response
from services.frontend.chat.stream import chat_chunks
from services.frontend.choices import ChoiceDelta
from services.frontend.engine_seam import GenerationDelta
from services.frontend.reasoning.plan import ReasoningPlan
from services.frontend.tools.plan import ToolPlan


def chunks_and_response(text: str, piece: int, tools: ToolPlan | None = None,
                        reasoning: ReasoningPlan | None = None,
                        ) -> tuple[list[pb.ChatCompletionChunk], pb.ChatCompletionResponse]:
    deltas = [GenerationDelta(text[i:i + piece], []) for i in range(0, len(text), piece)]
    deltas.append(GenerationDelta("", [], finish_reason="stop"))

    async def stream() -> AsyncIterator[ChoiceDelta]:
        for delta in deltas:
            yield ChoiceDelta(0, delta)

    async def run() -> tuple[list[pb.ChatCompletionChunk], pb.ChatCompletionResponse]:
        chunks = [c async for c in chat_chunks(stream(), response_id="r", model="m",
                                               include_usage=False, tools=tools,
                                               reasoning=reasoning)]
        response = await chat_response(stream(), response_id="r", model="m", logprobs=False,
                                       tools=tools, reasoning=reasoning)
        return chunks, response

    return asyncio.run(run())
