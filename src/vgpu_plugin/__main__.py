from vgpu_plugin.commands.cli import main

raise SystemExit(main())
