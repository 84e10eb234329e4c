"""hearth.app: everything a person touches: the Qt GUI (app/gui), the CLI (app/cli), the Hub
download manager (app/hub), the chat store and settings (app/store) and the API client (app/client).

Only this package imports Qt, and only from app/gui.
"""
