"""``python -m dbo_runtime``: the ``dbo-runtime`` CLI where the console script is not installed (the GPU box)."""

from dbo_runtime.cli.main import main

raise SystemExit(main())
