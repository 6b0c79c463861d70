"""sinkserve serving layer: a Ray Serve application. Packages by layer; a layer imports only from the
layers below it and from the shared modules at this level (``tests/test_imports.py`` checks it)::

    cli     sinkserve serve | cluster | canary | generate | model        (app/cli/)
     |
    http    Ingress: auth, body limits, validation, SSE, OpenAI bodies    (app/http/)
     |
    plan    planner: version draw, passages, tools, prefix key, pool      (app/plan/)
     |
    pool    LLMServer replicas, token bus, routers, failover, stats hub  (app/pool/)
     |
    state   store (SQLite / Redis), conversations, quotas, jobs           (app/state/)

    shared: builder (the Serve entry, ``app.builder:build_app``), settings, schemas, events, errors,
            metrics, log_masking, long_docs

A chat request walks it top to bottom: ``http.ingress`` parses and authenticates it, ``plan.planner``
picks a pool by prompt length (and a replica key), ``pool.streaming`` sends it to that pool's
``pool.server`` replica, whose engine writes the tokens straight back to the ingress on the token bus
(``engine/frontend/token_bus.py``); ``state`` keeps what outlives
the request (a conversation's turns, a tenant's token count, a job).
"""
