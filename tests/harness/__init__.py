"""What real-engine tests, benches, docs and GPU-session tools load from outside the wheel: the self-timer
(``selftime``), whether the engine can run here (``machine``), a run's record assembled again (``runs``), a
result's provenance (``report``) and top-k state bytes per layout (``topk_memory``)."""
