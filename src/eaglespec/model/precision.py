"""The precision a model runs at when the user leaves it to eaglespec: `dtype="auto"` and
`quant="auto"` (the commands' default) resolved from the checkpoint and the machine.

The rule is llama.cpp's: run a GGUF file at the precision it was stored in. A GGUF whose decoder
matrices are 4-bit (Q4_0, Q4_1, Q4_K) runs on a CPU through eaglespec's w4a8 kernel (the file's
own 4-bit codes, exact; activations quantized to int8 per group of 32, as llama.cpp computes its
4-bit formats), in bfloat16, the kernel's intended dtype: `w4a8` when the output head is stored
above 4 bits (it then runs at 8 bits per group of 32, Q8_0's grid, through the same kernel's
8-bit form), `w4a8-all` when it is 4-bit too. A GGUF whose decoder matrices are mostly wider
but at most 8 bits, with some at 4 (a "Q4_K_M" of a model whose row lengths K-quants cannot
take, such as Gemma-3-270M: Q5_0 matrices beside Q4_K ones), runs as `w4a8-mixed`: each matrix
at its stored width, the 4-bit ones through the 4-bit kernel and the wider ones through the
8-bit one, so none runs at fewer bits than its file holds. Anything else (a Hugging Face
folder, a GGUF stored at 8 bits or more, a GPU, a CPU without AVX2) runs unquantized in
float32, as before. An explicit dtype decides an auto quant: float32 or float16 asks for the
unquantized model.

Measured on the 2-core development VM (SmolLM2-135M Q4_1, eager, docs/benchmark-history.md):
float32 plain decoding about 21 tok/s, bfloat16 w4a8 about 160-170 (70-80 before the eager-step
kernels of 2026-11-25: the 8-bit head, the row ops, the fused layer).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

AUTO = "auto"
FOUR_BIT = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # the GGUF types w4a8's codes are exact on
# GGUF types above 4 bits that the 8-bit kernel holds (exact for Q8_0 and Q5_0's 32-value blocks)
UP_TO_EIGHT = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"})
_MATRICES = "attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down"
_DECODER = re.compile(rf"blk\.\d+\.({_MATRICES})\.weight")  # GGUF names of decoder matrices


@dataclass(frozen=True, slots=True)
class Precision:
    dtype: str  # float32 / bfloat16 / float16
    quant: str  # a quant.QUANT_MODES mode
    reason: str  # why, in a few words, when either was "auto"; "" when both were given


def choose(
    dtype: str,
    quant: str,
    *,
    device: str,
    storage: Mapping[str, str] | None,  # GGUF tensor name -> its type name; None: not a GGUF
    w4a8_missing: Callable[[], str | None],  # why the w4a8 kernel cannot run here, None if it can
) -> Precision:
    """Resolve "auto" in `dtype` and `quant` (canonical dtype names: float32, bfloat16, float16).
    Pure but for `w4a8_missing`, asked last (it may build the kernel)."""
    if dtype != AUTO and quant != AUTO:
        return Precision(dtype, quant, "")
    if quant == AUTO:
        quant, reason = _auto_quant(dtype, device, storage, w4a8_missing)
    else:
        reason = f"--quant {quant}"
    if dtype == AUTO:
        # the quantized kernels take bf16 activations; the unquantized model keeps fp32
        dtype = "float32" if quant == "none" else "bfloat16"
    return Precision(dtype, quant, reason)


def _auto_quant(
    dtype: str,
    device: str,
    storage: Mapping[str, str] | None,
    w4a8_missing: Callable[[], str | None],
) -> tuple[str, str]:
    if storage is None:
        return "none", "not a GGUF file: its weights as stored"
    decoder = [t for name, t in storage.items() if _DECODER.fullmatch(name)]
    four = sum(t in FOUR_BIT for t in decoder)
    mixed = four > 0 and all(t in FOUR_BIT | UP_TO_EIGHT for t in decoder)
    if not decoder or (2 * four < len(decoder) and not mixed):
        return "none", "a GGUF stored above 4 bits"
    if dtype not in (AUTO, "bfloat16"):
        return "none", f"--dtype {dtype} asks for the unquantized model"
    if device != "cpu":
        return "none", f"the 4-bit kernels run on CPU, not {device}"
    missing = w4a8_missing()
    if missing is not None:
        return "none", f"the w4a8 kernel cannot run here ({missing})"
    head = storage.get("output.weight", storage.get("token_embd.weight"))
    if 2 * four < len(decoder):
        return "w4a8-mixed", f"the GGUF's matrices at their widths (4 or 8 bits), head {head} at 8"
    if head in FOUR_BIT:
        return "w4a8-all", "the GGUF's 4-bit weights, 4-bit output head"
    return "w4a8", f"the GGUF's 4-bit weights, output head {head} at 8 bits"
