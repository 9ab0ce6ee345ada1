"""Start real vLLM engines and compare their runs: ``verify`` and ``tune``, and the e2e tests. The parent process
imports neither vLLM nor CUDA; the engine child (``harness.runner``) loads vLLM with the plugin and reads its state."""
