"""The ``pipeline`` engine kind: one model's decoder layers split across Ray stage actors.

``loading`` reads only a layer range's tensors from a checkpoint, ``stage`` is a stage's compute
and per-sequence KV caches (runnable without Ray), ``sampling`` and ``text`` are the origin's
decoding, ``origin`` drives a sequence through the stages, and ``engine`` is the engine kind.
"""
