from wsi_milssl.cli import main

raise SystemExit(main())
