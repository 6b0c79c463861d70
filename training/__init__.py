"""Training of the embedded reference model (assets/reference-model/)."""
