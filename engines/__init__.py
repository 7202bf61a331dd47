"""Engines, grouped by where the code runs: ``kit`` (what a kind builds on, in any process
that holds an engine), the kinds (``vllm``, ``pipeline``), ``replica`` (a model's Serve
replica), ``caller`` (the ingress side of a call: routing), ``channel`` (the token stream
between the two) and ``controllers`` (docs/tour.md)."""
