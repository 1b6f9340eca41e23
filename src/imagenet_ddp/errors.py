"""Errors a user can act on. The CLI prints them as one clear line and exits non-zero."""

import difflib


class InputError(Exception):
    """Bad or missing input: the message names the file (or config key) and what to do."""


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """The hint of a line refusing ``word``: its closest ``choices`` (up to three, each written
    with ``prefix``) as "did you mean 'a', 'b'? ", or "" where none is close."""
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f"did you mean {', '.join(repr(prefix + c) for c in close)}? " if close else ""
