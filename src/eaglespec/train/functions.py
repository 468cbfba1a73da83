"""Training prompts over human-written Python functions from the package registry, for the kind
of request the target's self-asked prompts and its own answers give few of: a real function to
complete from its signature and docstring (the form of the HumanEval set), to write from its
description, or to explain.

The functions come from the source of pure-Python utility libraries on PyPI (pinned wheels, read
out of the wheel, never installed): every public top-level function with a docstring. None of it
is an evaluation set's code. Each function becomes a stub, its signature and a docstring of its
first paragraph and up to three doctest examples (`stub`), asked for as "Complete the code I
provided." (the prompt `--completions` writes over the target's own answers), and one more
request picked by the seed: write it from its description, or explain its code.

    python -m eaglespec.train.functions --out functions.jsonl [--seed 0] [--libraries pydash ...]

The seed only picks each function's second request, so a later stage that wants prompts it has not
answered before needs functions it has not seen: libraries are added to LIBRARIES over time, and
`--libraries` names the ones a file is written from (the first four write the file of the stages
that read only those, byte for byte; the first eight that of stages 30-33, before sympy and mpmath
joined).

writes FastChat-style records (`{"turns": [prompt], "source": ...}`) that `eaglespec train
--data` reads like any prompt file.
"""

from __future__ import annotations

import ast
import copy
import doctest
import random
import tempfile
import textwrap
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from eaglespec.errors import EaglespecError, InvalidRequestError
from eaglespec.registry import pip_download
from eaglespec.train.data import prompt_file_parser, shuffled_records, write_prompt_file
from eaglespec.train.synth import COMPLETE

# The wheels read, by name (pinned: the prompts a seed writes stay the same), all pure Python,
# with docstrings that show examples the way HumanEval's prompts do (networkx: 986 functions, 597
# of them with examples; funcy's are described without examples). New libraries go at the end.
LIBRARIES = {
    "pydash": "pydash==8.0.4",
    "more-itertools": "more-itertools==10.5.0",
    "boltons": "boltons==24.1.0",
    "toolz": "toolz==1.0.0",
    "networkx": "networkx==3.4.2",
    "funcy": "funcy==2.0",
    "inflection": "inflection==0.5.1",
    "humanize": "humanize==4.11.0",
    "sympy": "sympy==1.13.3",  # 2,501 functions: symbolic maths, doctests in most
    "mpmath": "mpmath==1.3.0",
}
MAX_EXAMPLES = 3  # doctest examples kept in a stub's docstring
MAX_SOURCE_LINES = 40  # longer functions are not asked to be explained
WRITE = "Write a Python function named {name} for this description: {summary}"
EXPLAIN = "Explain what this Python function does.\n\n```python\n{code}\n```"


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    source: str  # "package/module.py:name"
    stub: str  # signature and short docstring, ending in a newline: the body is left to write
    summary: str  # the docstring's first paragraph, on one line
    code: str  # the whole function without its docstring (ast.unparse: no comments)


def _short_doc(doc: str) -> tuple[str, str]:
    """(summary, docstring text): the first paragraph on one line, and that paragraph wrapped
    followed by up to MAX_EXAMPLES doctest examples with their expected output."""
    summary = " ".join(doc.strip().split("\n\n")[0].split())
    examples = doctest.DocTestParser().get_examples(doc)[:MAX_EXAMPLES]
    lines = textwrap.wrap(summary, 84)  # as a docstring wraps it
    if examples:
        lines.append("")
    for ex in examples:
        src = ex.source.rstrip("\n").split("\n")
        lines += [">>> " + src[0]] + ["... " + s for s in src[1:]]
        lines += ex.want.rstrip("\n").split("\n") if ex.want else []
    return summary, "\n".join(lines)


def _signature(node: ast.FunctionDef) -> str:
    bare = copy.deepcopy(node)
    bare.decorator_list, bare.body = [], [ast.Pass()]
    return ast.unparse(bare).rsplit("\n", 1)[0]  # "def f(...):" without its "pass"


def module_functions(text: str, source: str) -> Iterator[Function]:
    """The public top-level functions of a module's source that have a docstring."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not doc.strip():
            continue
        summary, short = _short_doc(doc)  # a summary: the docstring is not blank
        body = "\n".join("    " + line if line else "" for line in short.split("\n"))
        stub = f'{_signature(node)}\n    """{body.lstrip()}\n    """\n'
        code = copy.deepcopy(node)
        code.decorator_list = []
        code.body = code.body[1:] or [ast.Pass()]  # the docstring dropped
        yield Function(node.name, f"{source}:{node.name}", stub, summary, ast.unparse(code))


def _is_test(member: str) -> bool:
    *folders, name = member.split("/")
    return name.startswith("test_") or any(f in ("test", "tests") for f in folders)


def wheel_functions(wheel: Path) -> list[Function]:
    """Every function `module_functions` finds in a wheel's modules (tests skipped)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            members = {
                m: z.read(m).decode("utf-8", errors="replace")
                for m in sorted(z.namelist())
                if m.endswith(".py") and not _is_test(m)
            }
    except (OSError, zipfile.BadZipFile) as e:  # missing, or not a zip
        raise InvalidRequestError(f"{wheel}: not a wheel ({e})") from e
    found = [f for m, text in members.items() for f in module_functions(text, m)]
    if not found:
        raise InvalidRequestError(f"{wheel}: no documented Python functions in it")
    return found


def function_prompts(
    functions: Sequence[Function], rng: random.Random
) -> Iterator[tuple[str, str]]:
    """(prompt, source) per function: the stub to complete, then one of writing it from its
    summary or explaining its code (explaining only functions of MAX_SOURCE_LINES or fewer)."""
    for f in functions:
        yield COMPLETE.format(stub=f.stub), f"{f.source}:complete"
        if rng.random() < 0.5 and f.code.count("\n") < MAX_SOURCE_LINES:
            yield EXPLAIN.format(code=f.code), f"{f.source}:explain"
        else:
            yield WRITE.format(name=f.name, summary=f.summary), f"{f.source}:write"


def build(wheels: Sequence[Path], seed: int) -> list[dict[str, object]]:
    """Every prompt over every wheel's functions, shuffled by `seed`, as FastChat-style records."""
    rng = random.Random(f"{seed}:functions")
    functions = [f for w in wheels for f in wheel_functions(w)]
    return shuffled_records(list(function_prompts(functions, rng)), rng)


def main(argv: list[str] | None = None) -> None:
    ap = prompt_file_parser(__doc__)
    ap.add_argument(
        "--wheel",
        type=Path,
        nargs="+",
        help="wheels already downloaded, read instead of --libraries'",
    )
    ap.add_argument(
        "--libraries",
        nargs="+",
        choices=list(LIBRARIES),
        default=list(LIBRARIES),
        help="the pinned libraries downloaded and read, in LIBRARIES' order (default: all)",
    )
    args = ap.parse_args(argv)
    specs = [spec for name, spec in LIBRARIES.items() if name in args.libraries]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            wheels = args.wheel or [
                pip_download(spec, Path(tmp) / str(i), []) for i, spec in enumerate(specs)
            ]
            records = build(wheels, args.seed)
    except EaglespecError as e:  # offline, or a --wheel without functions: one line
        raise SystemExit(f"eaglespec.train.functions: error: {e}") from e
    write_prompt_file("eaglespec.train.functions", args, records, lambda s: s.rsplit(":", 1)[1])


if __name__ == "__main__":
    main()
