"""hearth.app.gui: the PySide6 desktop app (chat, models, settings). The only package that imports
Qt, and only through ``hearth.app.gui.qt``. Entry point: ``hearth.app.gui.main.run(argv)``."""
