from vgpu_plugin.cli import main

raise SystemExit(main())
