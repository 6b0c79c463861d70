"""sinkserve serving layer: a Ray Serve application (ingress, whose planner picks a pool by prompt length -> per-bucket engine pools)."""
