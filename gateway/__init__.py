"""The gateway's Serve applications. ``app.py`` builds them (run by ``serve run`` / ``serve
deploy``) from ``config.py``; the folders say where the rest runs: ``edge``, ``ingress``,
``model_replica``, ``cluster`` (docs/tour.md)."""
