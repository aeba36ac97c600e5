"""Errors the user can act on: the CLI prints one line and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or an unmet requirement.

    ``message`` says what is wrong, ``hint`` what to do about it. ``str()`` gives both on one line.
    """

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        self.message = " ".join(message.split())
        self.hint = " ".join(hint.split())
        super().__init__(self.line())

    def line(self) -> str:
        return f"{self.message}: {self.hint}" if self.hint else self.message


class FidelityError(UserError):
    """A fidelity gate failed (exit code 3)."""

    exit_code = 3
