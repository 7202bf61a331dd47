"""Runs in the model replica: drives a controlled request from the engine's frontend as
segments, one decision per controller answer (docs/controllers.md)."""
