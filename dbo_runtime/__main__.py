from dbo_runtime.cli.main import main

raise SystemExit(main())
