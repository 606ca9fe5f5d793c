"""The error a user's configuration mistake raises: every problem at once, each naming its flag, key or file and
the fix. The CLIs print it as one message and exit with code 2 (docs/errors.md)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user's configuration mistake; the message lists every problem with the flag and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("Invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
