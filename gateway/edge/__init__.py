"""Runs at the edge of each node, before any replica: in Serve's HTTP proxy (its own answers
and refusals) and in the HAProxy launcher (its config, error pages and model routing)
(docs/cluster.md, "The public port")."""
