from eaglespec.cli import main

raise SystemExit(main())
