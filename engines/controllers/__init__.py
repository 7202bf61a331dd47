"""AICI-style per-step controllers (issue 12), built up in parts.

``shm`` is the transport of the aicirt protocol (``docs/protocols/controller-runtime.md``): JSON
messages and the logit-bias matrix in POSIX shared memory, driven from the engine end and from
the runtime end, so the engine can also talk to a conforming external runtime.
"""
