"""Measurement harnesses loaded into real-engine runs from outside the wheel (``selftime``)."""
