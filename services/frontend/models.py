"""The models a server serves (``ListModels``, ``GetModel``) and its tokenizer as an API
(``Tokenize``, ``Detokenize``).

Owns the model cards (the base model, then its LoRA adapters with it as their parent, as
vLLM lists them) and the tokenize/detokenize answers. It does not own which names resolve
to which model (``served_model``).
"""

from __future__ import annotations

from engine_common.input_processor import InputProcessor, InvalidRequestError
from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.chat.request import call_format_of, chat_messages
from services.frontend.errors import InvalidArgument, NotFound, quoted
from services.frontend.request_params import optional_flag
from services.frontend.served_model import ServedModel
from services.frontend.validation import (
    RENDERED_CHAT,
    chat_template_kwargs,
    check_text_length,
)


def models_response(model: ServedModel) -> pb.ListModelsResponse:
    """The base model, then its LoRA adapters with it as their parent (as vLLM lists them)."""
    base = pb.Model(id=model.name, object="model", created=model.created,
                    owned_by=model.owned_by, max_model_len=model.max_model_len)
    adapters = [pb.Model(id=name, object="model", created=model.created,
                         owned_by=model.owned_by, max_model_len=model.max_model_len,
                         parent=model.name) for name in sorted(model.lora_names)]
    return pb.ListModelsResponse(object="list", data=[base, *adapters])


def model_card(model: ServedModel, requested: str) -> pb.Model:
    """The card ``models_response`` lists for ``requested`` (an alias names the base
    model's); NotFound, in OpenAI's words, for a model not served here."""
    base = model.name if requested in model.aliases else requested
    for card in models_response(model).data:
        if card.id == base:
            return card
    raise NotFound(f"The model {quoted(requested)} does not exist",
                   reason="model_not_found", param="model")


def tokenize_response(request: pb.TokenizeRequest, inputs: InputProcessor) -> pb.TokenizeResponse:
    if request.prompt and request.messages:
        raise InvalidArgument("give either prompt or messages, not both")
    if request.messages:
        messages = chat_messages(request.messages, inputs.max_model_len, call_format_of(inputs))
        # Counting a conversation as it stands needs the template without the assistant's
        # turn header that generation appends.
        rendered = inputs.render_chat(
            messages, template_kwargs=chat_template_kwargs(request),
            add_generation_prompt=optional_flag(request, "add_generation_prompt", True),
            continue_final_message=optional_flag(request, "continue_final_message", False))
        check_text_length(len(rendered), inputs.max_model_len, RENDERED_CHAT)
        tokens = inputs.tokenize_rendered(rendered)
    elif request.prompt:
        check_text_length(len(request.prompt), inputs.max_model_len, "prompt")
        add_special_tokens = (request.add_special_tokens
                              if request.HasField("add_special_tokens") else True)
        tokens = inputs.tokenize(request.prompt, add_special_tokens=add_special_tokens)
    else:
        raise InvalidArgument("give a prompt or messages to tokenize")
    return pb.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=inputs.max_model_len)


def detokenize_response(request: pb.DetokenizeRequest,
                        inputs: InputProcessor) -> pb.DetokenizeResponse:
    try:
        return pb.DetokenizeResponse(prompt=inputs.detokenize(list(request.tokens)))
    except InvalidRequestError as error:
        raise InvalidArgument(f"tokens: {error}") from error

