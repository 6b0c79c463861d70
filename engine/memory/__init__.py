"""Where the KV cache's blocks live and which stay: the block manager, retention (sinks, anchors,
window), the packed block codec and budget, and the session KV stores (directory, Redis, tiered).
Pure Python except the codec: this layer never imports torch at module level."""
