"""Parsing of command-line values that argparse's types do not cover, with errors that name the
flag (an `InvalidRequestError`, which the CLI prints as one line)."""

from __future__ import annotations

from eaglespec.config import TreeConfig
from eaglespec.errors import InvalidRequestError


def int_list(text: str, flag: str) -> list[int]:
    """'2,15,27' -> [2, 15, 27]; anything else names `flag` and the text."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise InvalidRequestError(f"{flag} takes comma-separated integers, got '{text}'") from None


def tree_config(text: str, flag: str) -> TreeConfig:
    """'4,4,16' -> TreeConfig(depth=4, top_k=4, num_nodes=16); anything else names `flag`."""
    values = int_list(text, flag)
    if len(values) != 3:
        raise InvalidRequestError(f"{flag} takes DEPTH,TOPK,NODES, got '{text}'")
    return TreeConfig(depth=values[0], top_k=values[1], num_nodes=values[2])
