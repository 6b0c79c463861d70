"""The engine pools and the way to and from them: the ``LLMServer`` replicas, their Serve routers
(session and prefix affinity), the token bus back to the ingress, failover between pools, placement
and the stats hub."""
