"""Running `eaglespec <command>` as a user types it: its own process, an EAGLESPEC_HOME of its own
(the user's downloaded models linked in, pulled first if need be; a calibration folder of its
own, so nothing a test run learns is left in the user's cache), and the plain greedy answer of
the default model to compare with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from eaglespec import LLM, SamplingParams
from eaglespec.generate import generate_stream
from eaglespec.paths import cache_dir
from eaglespec.registry import pull
from eaglespec.requests import RequestOutput, collect_outputs

DEFAULT_MODEL = "smollm2-135m"


def user_home(home: Path) -> Path:
    pull(DEFAULT_MODEL, progress=False)
    (home / "models").symlink_to(cache_dir() / "models", target_is_directory=True)
    return home


def command_env(home: Path) -> dict[str, str]:
    return {**os.environ, "EAGLESPEC_HOME": str(home)}


def eaglespec(
    args: list[str], home: Path, timeout: float = 300, **kw
) -> subprocess.CompletedProcess:
    """`eaglespec ARGS` in its own process; its status, stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "eaglespec", *args],
        env=command_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def plain_output(llm: LLM, ids: list[int], max_tokens: int) -> RequestOutput:
    """Plain greedy decoding's answer to `ids`."""
    params = SamplingParams(max_tokens=max_tokens)
    return collect_outputs(generate_stream(llm.model, llm.tokenizer, [ids], [params]))[0]


def plain_text(llm: LLM, ids: list[int], max_tokens: int) -> str:
    return plain_output(llm, ids, max_tokens).text
