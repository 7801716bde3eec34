from securevfl.cli import main

raise SystemExit(main())
