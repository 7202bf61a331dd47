"""Runs in the controller runtime's process, a child of the model replica: the seed's commands,
live controllers, the tag registry, time-bounded calls, and the built-in controllers (none,
llguidance, declctrl, reasoning) (docs/protocols/controller-runtime.md)."""
