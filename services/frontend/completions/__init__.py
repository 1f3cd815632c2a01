"""OpenAI's completions API: a request resolved (``request``) and its answer (``response``)."""
