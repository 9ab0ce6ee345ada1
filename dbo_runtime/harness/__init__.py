"""Run the real vLLM engine and compare runs: the machinery behind ``dbo-runtime verify``,
``tests/e2e`` and ``graphs/bench_real_engine.py``.

Why it lives in the package: the operator canary (``verify``) and the project's
own real-engine proof must be the same code -- a test harness that diverged from
what operators run would prove nothing about it. Nothing here is imported by the
plugin itself; vLLM is imported only inside the child processes
(``harness.runner``), so the parent (CLI, pytest) stays light and CUDA-free.
"""
