"""Moving paged KV blocks from a prefill replica's cache to a decode replica's over UCX.

``connector`` is the interface the engine codes against (and ``layout`` the cache shape both
sides compare); ``ucx_connector`` implements it on ``ucxx``. Importing this package loads
neither torch nor UCX: a gateway reads handles and layouts without them.
"""
