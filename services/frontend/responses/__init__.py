"""OpenAI's Responses API over the chat API: translated to a chat and back (``translate``),
kept for ``previous_response_id`` (``store``), its input items listed (``input_items``) and
run in the background (``background``)."""
