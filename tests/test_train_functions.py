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


def test_libraries_names_the_wheels_downloaded_in_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def download(spec: str, dest: Path, extra: list[str]) -> Path:
        asked.append(spec)
        name = spec.split("==")[0]
        return _wheel(tmp_path / f"{name}-0-py3-none-any.whl", {f"{name}/mod.py": MODULE})

    monkeypatch.setattr(functions, "pip_download", download)
    out = tmp_path / "functions.jsonl"
    functions.main(["--out", str(out), "--libraries", "networkx", "pydash"])
    assert asked == [functions.LIBRARIES["pydash"], functions.LIBRARIES["networkx"]]
    sources = {json.loads(line)["source"].split("/")[0] for line in out.read_text().splitlines()}
    assert sources == {"pydash", "networkx"}
    asked.clear()
    functions.main(["--out", str(out)])  # the default: every library
    assert asked == list(functions.LIBRARIES.values())
    with pytest.raises(SystemExit):
        functions.main(["--out", str(out), "--libraries", "numpy"])  # not a pinned library


def test_exclude_leaves_out_the_prompts_an_earlier_file_asked(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "pkg-0-py3-none-any.whl", {"pkg/mod.py": MODULE})
    first, again = tmp_path / "first.jsonl", tmp_path / "again.jsonl"
    functions.main(["--out", str(first), "--wheel", str(wheel), "--seed", "3"])
    records = [json.loads(line) for line in first.read_text().splitlines()]
    earlier = tmp_path / "earlier.jsonl"  # an earlier stage asked two of the four
    earlier.write_text("".join(json.dumps({"turns": r["turns"]}) + "\n" for r in records[1:3]))
    functions.main(
        ["--out", str(again), "--wheel", str(wheel), "--seed", "3", "--exclude", str(earlier)]
    )
    kept = [json.loads(line) for line in again.read_text().splitlines()]
    assert kept == [records[0], records[3]]  # the rest, in their order
    with pytest.raises(SystemExit, match="cannot read training data .*missing.jsonl"):
        functions.main(
            [
                "--out",
                str(again),
                "--wheel",
                str(wheel),
                "--exclude",
                str(tmp_path / "missing.jsonl"),
            ]
        )
