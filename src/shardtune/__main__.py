from shardtune.cli import main

raise SystemExit(main())
