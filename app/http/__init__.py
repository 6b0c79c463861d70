"""The HTTP edge: the ingress deployment, auth, body limits, SSE framing, the OpenAPI document, and the
OpenAI response bodies made of a request's token deltas."""
