"""Runs in a model replica (the Ray Serve replica of a model's engine deployment): the engine
host that holds every kind to the stream contract (admission, deadlines, priority, a reasoning
model's split, accounting), the deployment itself, and what watches its callers, offloads its
CPU-heavy calls and routes its log lines (docs/tour.md)."""
