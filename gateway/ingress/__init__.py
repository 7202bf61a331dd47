"""Runs in every replica that answers HTTP: the gateway's ingress replicas and each replica of a
model's own application. The FastAPI app that mounts the protocols, the model registry, keys,
limits, the tenant meter, metrics and the engine client (docs/tour.md)."""
