"""OpenAI's chat completions API: a request resolved (``request``), its streamed chunks
(``stream``) and its whole answer (``response``)."""
