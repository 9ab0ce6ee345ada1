"""dbo_runtime: DBO execution contexts for vLLM 0.33 (a ``vllm.general_plugins`` plugin).

Layering, one direction only: ``integration`` (the only code naming vLLM) ->
``services`` (SMControl, schedule cache, top-k state) -> ``core`` (pure
policy and value types). ``adapters`` wrap third-party SM knobs and are
imported lazily, so importing this package never initialises CUDA.
"""

__version__ = "0.1.0"
