"""Runs in the process that calls a model's engine deployment (a gateway ingress replica, a
model's own ingress): Serve's request router that picks a replica by prefix cache and load, and
the question HAProxy's router asks it (docs/routing.md)."""
