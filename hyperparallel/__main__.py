from hyperparallel.cli import main

raise SystemExit(main())
