"""What real-engine tests, benches and GPU-session tools load from outside the wheel: the self-timer
(``selftime``), whether the engine can run here (``machine``), a run's record assembled again (``runs``)
and a result's provenance (``report``)."""
