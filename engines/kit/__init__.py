"""The kit an engine kind builds on, and what starts one: the ``Engine`` interface, a model's
configuration, tokens and detokenization, the embedded model, LoRA checks, metrics, the kinds'
registry, core placement and the reaper. Runs in every process that holds an engine: the model
replica and, for the pipeline kind, its stage actors (docs/extending.md)."""
