"""The pieces of Tandem's Envoy configuration that are not Python dicts: the Lua scripts of
the HTTP edge (``*.lua``, package data) and the HTTP rules of ``tandem.v1.Generation`` read
from the descriptor set, from which the routes are made.

``deploy.envoy_config`` assembles them into a bootstrap; nothing here runs Envoy or writes
files.
"""
