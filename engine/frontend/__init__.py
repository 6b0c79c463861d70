"""Between a server and the engine: the engine process and its client (typed messages over a pipe), the
in-process async engine, and grammar admission (``response_format`` compiled before a request is queued)."""
