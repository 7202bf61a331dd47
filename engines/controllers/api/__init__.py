"""What a controller's author writes against: the per-step interface, token masks, and an
example an operator registers. Controllers run in the controller runtime's process
(docs/controllers.md)."""
