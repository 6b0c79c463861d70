"""sinkserve serving layer: a Ray Serve application (ingress -> router -> per-bucket engine pools)."""
