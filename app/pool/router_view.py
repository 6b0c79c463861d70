"""What this process's Serve routers can route to: the ingress's second witness of a pool's live replicas.

Serve pickles a request router's module *by value* (``RequestRouterConfig`` registers it with
cloudpickle), so state kept in ``app/pool/affinity.py`` itself would live in a copy of that module's globals,
one the ingress never reads. This module is pickled by reference: the router registers itself here, and
the ingress reads the same dict (``Ingress._deployment_ready``; docs/cluster.md: the hub alone once
refused a call to a busy pool whose entry had lapsed)::

    ingress process
      handle("pool-long-v1") -> Serve router -> SessionAffinityRouter.initialize_state -> register(...)
      Ingress._deployment_ready("pool-long-v1"): hub lists it?  no -> routed_replicas(...) = 2 -> live
"""

from __future__ import annotations

import weakref
from typing import Any

# deployment name -> this process's router for it (one per handle; the ingress holds one per pool).
_ROUTERS: dict[str, "weakref.ReferenceType[Any]"] = {}


def register(deployment: str, router: Any) -> None:
    """Record ``router`` (anything with Serve's ``curr_replicas``) as this process's router for ``deployment``."""
    _ROUTERS[deployment] = weakref.ref(router)


def routed_replicas(deployment: str) -> int | None:
    """How many replicas of ``deployment`` this process's Serve router can route to now, or None when no
    router for it exists here yet (no call made). Serve's controller pushes the running set, and a replica
    whose actor died is dropped at its first failed call: Serve's own view, beside the StatsHub's, whose
    entry for a live but loaded replica can lapse (``stats_ttl_s``)."""
    ref = _ROUTERS.get(deployment)
    router = ref() if ref is not None else None
    return None if router is None else len(router.curr_replicas)
