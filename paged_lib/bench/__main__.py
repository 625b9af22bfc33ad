from paged_lib.bench.attention import main

raise SystemExit(main())
