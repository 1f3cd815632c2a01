"""The front end: the public, OpenAI-shaped ``tandem.v1.Generation`` API over any engine.

Both the replica and the gateway serve it, identically: the replica over its local engine,
the gateway over the replicas behind it. The one contract with an engine is the seam
(``engine_seam``): a ``GenerateFn`` that streams ``GenerationDelta``s for one
``GenerationRequest`` within a ``CallContext``.

- ``generation_servicer``: the RPC handlers; ``errors``: failures as statuses;
  ``validation``, ``request_params``: checks and the sampling parameters of a request;
- ``completions/``, ``chat/``: requests in, answers out; ``choices``: the ``n`` choices;
  ``output_fields``: usage and logprobs shapes they share;
- ``tools/``, ``reasoning/``: tool calls and thinking, parsed out of the output as it streams;
- ``responses/``: the Responses API, translated to a chat, stored, listed, run in the
  background;
- ``models``, ``served_model``, ``lora_updates``: the names a server answers to;
  ``server_sent_events``: the ``*Events`` RPCs that Envoy passes to HTTP clients as SSE.

It never imports the replica (``services.replica``) or the gateway.
"""
