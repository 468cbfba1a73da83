"""Parsing of command-line values that argparse's types do not cover, with errors that name the
flag (an `InvalidRequestError`, which the CLI prints as one line)."""

from __future__ import annotations

from eaglespec.errors import InvalidRequestError


def int_list(text: str, flag: str) -> list[int]:
    """'2,15,27' -> [2, 15, 27]; anything else names `flag` and the text."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise InvalidRequestError(f"{flag} takes comma-separated integers, got '{text}'") from None
