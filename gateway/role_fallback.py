"""Noticing when one role's work is done by the other because no replica of it is usable.

Owns the count (``tandem:gateway_role_fallbacks_total{missing_role}``, one per routed request
or resumption) and the log: one line when a role goes missing, one when it is back, not one
per request. It does not own the choice (``picker`` makes it from the snapshot, and a role
back in rotation ends it at the next pick); the proxy and the endpoint picker report each
decision here.
"""

from __future__ import annotations

import logging

from gateway.metrics import GatewayMetrics
from gateway.picker import RoutingDecision

logger = logging.getLogger(__name__)

_WHAT = {
    "decode": "no decode replica is usable: prefill replicas run requests whole",
    "prefill": "no prefill replica is usable: decode replicas compute prompts themselves",
}


class RoleFallbacks:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._missing = ""  # the role missing at the last decision ("" none)

    def observe(self, decision: RoutingDecision) -> None:
        """Count a decision that stands in for a missing role; log a change of the state."""
        missing = decision.missing_role
        if missing:
            self._metrics.role_fallbacks.labels(missing).inc()
        if missing == self._missing:
            return
        if self._missing:
            logger.warning("%s replicas are usable again: roles as configured",
                           self._missing)
        if missing:
            logger.warning("%s (first: %s)", _WHAT[missing], decision.decode.address)
        self._missing = missing
