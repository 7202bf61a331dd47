"""Between the model replica and its controller runtime: the aicirt shared-memory transport,
the two channels' ends over it, and the typed messages they carry
(docs/protocols/controller-runtime.md)."""
