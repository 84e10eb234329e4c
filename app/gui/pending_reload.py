"""A reload that waits for the answers being written to end (``PendingReload``): the model chosen,
the model in use again with changed engine options, or another backend (see ``main_window``).

Reloading under an answer would cut it off, and switching the backend under it would send its chat's
next turn elsewhere, so the window keeps one of these until no answer is running or waiting."""

from __future__ import annotations

from dataclasses import dataclass

from hearth.app.gui.backend import ModelChoice


@dataclass
class PendingReload:
    """What to do once no answer is being written: load ``choice`` (the model in use again when
    ``options_changed``), or, with ``switch``, go over to the saved backend and load one of its models
    (which wins: the models of the backend left behind are no choice there)."""

    choice: ModelChoice | None = None
    switch: bool = False
    options_changed: bool = False

    def load(self, choice: ModelChoice) -> None:
        """The user chose ``choice``: it replaces any model waiting to load."""
        self.choice, self.options_changed = choice, False

    def reload(self, in_use: ModelChoice) -> None:
        """Engine options changed: reload the model in use, unless another one waits to load (it
        loads with the new options anyway)."""
        if self.choice is None:
            self.choice, self.options_changed = in_use, True

    def describe(self, target: str, answers: int) -> str:
        """The status bar's line; ``target`` names the backend switched to, ``answers`` is how many
        are being written or waiting."""
        when = "when the answer ends" if answers <= 1 else "when the answers end"
        if self.switch:
            return f"Will switch to {target} {when}"
        assert self.choice is not None
        if self.options_changed:
            return f"Engine options changed: {self.choice.label} will reload {when}"
        return f"{self.choice.label} will load {when}"
