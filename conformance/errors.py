"""The error a run raises when it cannot go on as asked: a leaf, so every layer can raise it."""


class RunError(ValueError):
    """The run cannot start (or go on) as asked; the message names the option or file and what to do."""
