"""Planning a request: what it becomes before it reaches a pool (version, passages, tools, prompt, the
prefix routing key, the pool by length), on a bounded thread pool off the ingress's event loop."""
