"""Errors a user can act on. The CLI prints them as one clear line and exits non-zero."""


class InputError(Exception):
    """Bad or missing input: the message names the file (or config key) and what to do."""
