from adaptlm.cli import main

raise SystemExit(main())
