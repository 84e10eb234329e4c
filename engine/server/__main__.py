"""``python -m hearth.engine.server``: see ``hearth.engine.server.main``."""

from hearth.engine.server.main import main

raise SystemExit(main())
