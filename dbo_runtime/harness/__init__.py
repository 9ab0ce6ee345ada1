"""Start real vLLM engines and compare their runs: the machinery behind ``dbo-runtime verify`` and
``tune``, shared with the project's e2e tests so that the operator's canary and the project's proof
are the same code.

Not part of the plugin, but not independent of it either: the engine child (``harness.runner``)
loads vLLM with dbo_runtime installed and reads the plugin's state. The parent process (CLI, pytest)
imports neither vLLM nor CUDA; whether the engine can run here at all is ``tests/harness/machine.py``'s.
"""
