"""benchmarks/head_average.py: two heads averaged weight by weight, lm_head rows by target token."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from eaglespec.errors import InvalidRequestError

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "head_average.py"
spec = importlib.util.spec_from_file_location("head_average", SCRIPT)
assert spec is not None and spec.loader is not None
head_average = importlib.util.module_from_spec(spec)
spec.loader.exec_module(head_average)


def head(ids: list[int], rows: list[float], fc: float) -> dict[str, torch.Tensor]:
    """A head whose draft tokens are target `ids`, lm_head row i all `rows[i]`, fc all `fc`."""
    n = len(ids)
    return {
        "d2t": torch.tensor(ids) - torch.arange(n),
        "t2d": torch.zeros(8, dtype=torch.bool).index_fill(0, torch.tensor(ids), True),
        "lm_head.weight": torch.tensor(rows)[:, None].expand(n, 2).to(torch.bfloat16),
        "fc.weight": torch.full((2, 3), fc, dtype=torch.bfloat16),
    }


A = head([0, 2, 5], [1.0, 2.0, 3.0], fc=1.0)
B = head([0, 1, 2, 5], [3.0, 7.0, 4.0, 5.0], fc=2.0)


def test_keeps_bs_vocabulary_and_matches_rows_by_token() -> None:
    out = head_average.average(A, B, 0.25, "b")
    assert torch.equal(out["d2t"], B["d2t"]) and torch.equal(out["t2d"], B["t2d"])
    # tokens 0, 2, 5: 0.75 A + 0.25 B; token 1 (only B's): B's row
    assert out["lm_head.weight"][:, 0].tolist() == [1.5, 7.0, 2.5, 3.5]
    assert out["fc.weight"].unique().tolist() == [1.25]
    assert out["fc.weight"].dtype == torch.bfloat16


def test_keeps_as_vocabulary() -> None:
    out = head_average.average(A, B, 0.5, "a")
    assert torch.equal(out["d2t"], A["d2t"])
    assert out["lm_head.weight"][:, 0].tolist() == [2.0, 3.0, 4.0]
    assert out["fc.weight"].unique().tolist() == [1.5]


def test_refuses_what_cannot_be_averaged() -> None:
    with pytest.raises(InvalidRequestError, match="every token of A"):
        head_average.average(B, A, 0.5, "a")  # A lacks B's token 1
    with pytest.raises(InvalidRequestError, match="tensors differ"):
        head_average.average(A, {k: v for k, v in B.items() if k != "fc.weight"}, 0.5, "b")
    wider = {**B, "lm_head.weight": B["lm_head.weight"].repeat(1, 2)}  # another hidden size
    with pytest.raises(InvalidRequestError, match="lm_head.weight"):
        head_average.average(A, wider, 0.5, "b")
