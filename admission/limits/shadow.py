"""Shadow mode: a tenant's limits are evaluated and counted, not enforced.

An SRE marks a tenant (or the whole policy) `shadow: true` to see what new limits would do on
live traffic: every decision is counted in `admission_shadow_decisions_total{tenant, would}` and
a refusal that did not happen is logged; the request goes on as if its limits had said yes.
"""

from __future__ import annotations

import logging

from admission.errors import AdmissionError, RequestTooLarge, Throttled
from admission.metrics import Metrics
from admission.policy import Tenant

log = logging.getLogger(__name__)


def let_through(tenant: Tenant, denied: AdmissionError | None, metrics: Metrics) -> bool:
    """True when the request goes on: its limits allowed it, or they are only shadowed.
    Only limit decisions are shadowed; a store outage under fail-closed still refuses."""
    if not tenant.shadow:
        return denied is None
    if denied is None:
        metrics.shadow_decisions.labels(tenant.id, "admit").inc()
        return True
    if not isinstance(denied, (Throttled, RequestTooLarge)):
        return False
    metrics.shadow_decisions.labels(tenant.id, denied.code).inc()
    log.info("shadow: tenant %s would have been refused (%s); admitted", tenant.id, denied.code)
    return True
