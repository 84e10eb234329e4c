"""Hearth's persistent state that is not model weights: settings (JSON under the config folder)
and chats. Qt-free, so the GUI and the CLI share it."""
