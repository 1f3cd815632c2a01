"""A discrete-event model of a Tandem cluster that routes with the gateway's real code.

The gateway side is the real thing (``gateway.picker.pick``, ``gateway.prefix_index``,
``gateway.load``); each replica is the engine's real scheduler and KV-cache manager
(``engine_common``) whose forward pass is replaced by a step-time cost model fitted to the
real engine on this machine (``fit_costs``). ``bench/routing_simulation.py`` drives it; see
``docs/routing-simulation.md``.
"""
