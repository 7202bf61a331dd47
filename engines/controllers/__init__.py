"""AICI-style per-step controllers (docs/controllers.md), grouped by where the code runs:
``api`` (what a controller implements), ``runtime`` (the controller runtime's own process),
``ipc`` (the shared-memory transport and typed messages between it and the model replica) and
``driver`` (the model replica's side of a controlled request)."""
