"""Command-line usage errors: a bad flag or path is one line on stderr and exit status 2.

A user who mistypes a path should read what is wrong, not a 30-line traceback from the
model loader, and read it before minutes of loading; so the commands check their flags
and paths first and raise ``UsageError``, which ``forkserve.interfaces.cli.main`` prints.
"""
from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(Exception):
    """A flag or path the command cannot use; the message is the whole explanation."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise ``UsageError`` instead of printing the usage block and
    exiting, so argparse's own errors read like every other usage error: one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")
