"""Runs in the replicas of a model's own Serve application: each is the model's engine replica
and the HTTP server of every protocol for it, and its ingress request router answers HAProxy
(docs/cluster.md, "The default layout")."""
