"""Prompts over registry code (train/functions.py): the stubs, the prompt kinds and the wheel
reader, on a small module and a wheel-shaped zip built here (no download)."""

from __future__ import annotations

import ast
import json
import random
import zipfile
from pathlib import Path

import pytest

from eaglespec.train import functions
from eaglespec.train.data import read_conversations

MODULE = '''
import functools


@functools.cache
def below(l: list, t: int = 3) -> bool:
    """Return True if all numbers in the list l are below threshold t.

    Args:
        l: the numbers.

    >>> below([1, 2], 5)
    True
    >>> below(
    ...     [9], 5)
    False
    >>> below([], 1)
    True
    >>> below([4], 4)
    False
    """
    # a comment the explained code loses
    return all(x < t for x in l)


def plain(a):
    """Double a."""
    return a * 2


def _private(a):
    """Not asked for."""
    return a


def undocumented(a):
    return a


class Box:
    def method(self):
        """Methods are not asked for."""
'''


def _found() -> list[functions.Function]:
    return list(functions.module_functions(MODULE, "pkg/mod.py"))


def test_public_documented_top_level_functions_become_stubs() -> None:
    found = _found()
    assert [f.name for f in found] == ["below", "plain"]
    below = found[0]
    assert below.source == "pkg/mod.py:below"
    assert below.summary == "Return True if all numbers in the list l are below threshold t."
    lines = below.stub.split("\n")
    assert lines[0] == "def below(l: list, t: int=3) -> bool:"  # no decorator
    assert lines[1] == '    """Return True if all numbers in the list l are below threshold t.'
    # three examples of four, continuation lines kept, "Args:" dropped; the body left to write
    assert below.stub.count(">>> ") == 3 and "    ...     [9], 5)" in below.stub
    assert "Args" not in below.stub and "below([4], 4)" not in below.stub
    assert below.stub.endswith('    >>> below([], 1)\n    True\n    """\n')
    tree = ast.parse(below.stub + "    pass\n")  # a stub plus a body is Python
    assert ast.get_docstring(tree.body[0]).startswith("Return True")
    assert "return all(" in below.code and "x < t for x in l" in below.code
    assert '"""' not in below.code and "comment" not in below.code and "@" not in below.code
    assert found[1].stub == 'def plain(a):\n    """Double a.\n    """\n'


def test_each_function_is_completed_and_written_or_explained() -> None:
    found = _found()
    pairs = list(functions.function_prompts(found, random.Random(0)))
    assert len(pairs) == 2 * len(found)
    for f, (complete, second) in zip(found, zip(pairs[::2], pairs[1::2], strict=True), strict=True):
        assert complete == ("Complete the code I provided.\n\n" + f.stub, f.source + ":complete")
        kind = second[1].rsplit(":", 1)[1]
        assert kind in ("write", "explain")
        if kind == "write":
            assert second[0] == functions.WRITE.format(name=f.name, summary=f.summary)
        else:
            assert f.code in second[0] and second[0].startswith("Explain")
    kinds = {
        s.rsplit(":", 1)[1]
        for seed in range(8)
        for _, s in functions.function_prompts(found, random.Random(seed))
    }
    assert kinds == {"complete", "write", "explain"}  # the seed picks both ways


def _wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_build_reads_wheels_and_writes_prompts_the_trainer_reads(tmp_path: Path) -> None:
    wheel = _wheel(
        tmp_path / "pkg-0-py3-none-any.whl",
        {"pkg/mod.py": MODULE, "pkg/tests/test_mod.py": MODULE, "pkg/broken.py": "def (:"},
    )
    out = tmp_path / "new" / "functions.jsonl"  # --out's folder is made
    functions.main(["--out", str(out), "--wheel", str(wheel), "--seed", "3"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4  # two functions, two prompts each; tests and bad syntax skipped
    names = {r["source"].rsplit(":", 1)[0] for r in records}
    assert names == {"pkg/mod.py:below", "pkg/mod.py:plain"}
    assert records == functions.build([wheel], 3)  # seeded: the same file again
    conversations = read_conversations(out)
    assert [c.turns[0] for c in conversations] == [r["turns"][0] for r in records]


def test_a_wheel_without_functions_is_named_in_one_line(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "other-0-py3-none-any.whl", {"other/__init__.py": "X = 1\n"})
    out = tmp_path / "functions.jsonl"
    with pytest.raises(SystemExit, match=r"other-0-py3-none-any\.whl: no documented Python"):
        functions.main(["--out", str(out), "--wheel", str(wheel)])
    with pytest.raises(SystemExit, match="missing.whl: not a wheel"):
        functions.main(["--out", str(out), "--wheel", str(tmp_path / "missing.whl")])
    assert not out.exists()  # nothing half-written
