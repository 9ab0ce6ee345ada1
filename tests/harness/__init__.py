"""What real-engine tests and benches load from outside the wheel: the self-timer (``selftime``) and
whether the engine can run here (``machine``)."""
