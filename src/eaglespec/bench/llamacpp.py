"""llama.cpp as a reference engine in `eaglespec bench`: its plain decoding of the same GGUF file,
through the llama-cpp-python package (optional, not a dependency: `pip install llama-cpp-python`).

A CPU user compares eaglespec with llama.cpp's plain decode speed on the same file and machine, so
this method gets what eaglespec's methods get: the chat-templated prompt ids eaglespec built (fed
as ids, never re-tokenized), greedy decoding, the same max_tokens and EOS ids, torch's thread
count, and a fresh KV cache per generation (`reset()` before each, so llama-cpp-python's prefix
reuse never skips a prefill that eaglespec pays). Timing follows GenerationStats: prefill is the
time to the first token, decode everything after it. The output is an eaglespec RequestOutput
made by the same stop rules (requests.append_token), so runner, aggregate and report treat it like
any method.

llama.cpp computes with its own kernels (quantized dot products, other summation orders), so its
greedy tokens may differ from eaglespec's: it is a reference engine, reported by how many outputs
match plain decoding's, never as a losslessness failure. Only greedy decoding runs: two engines
sampling from different random streams give outputs that do not compare.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eaglespec.config import SamplingParams
from eaglespec.errors import InvalidRequestError
from eaglespec.model.loader import LoadedModel
from eaglespec.requests import RequestOutput, account_time, append_token, new_states

LLAMA_CPP = "llama.cpp"
GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file
MIN_CONTEXT = 512  # smallest llama.cpp context created (its batch size)


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version; InvalidRequestError when it does not import."""
    try:
        import llama_cpp
    except ImportError as e:
        raise InvalidRequestError(
            f"method '{LLAMA_CPP}' needs the llama-cpp-python package, which does not import "
            f"({e}): pip install llama-cpp-python"
        ) from e
    return str(llama_cpp.__version__)


def check_llama_cpp(temperature: float, device: str) -> None:
    """Everything the method needs that is known before the loads, except the model file (see
    check_gguf): the package, greedy decoding, and llama.cpp on the target's device."""
    llama_cpp_version()
    if temperature > 0:
        raise InvalidRequestError(
            f"method '{LLAMA_CPP}' runs greedy only (--temperature 0): llama.cpp samples from "
            "its own random stream, so sampled outputs would not compare with eaglespec's"
        )
    if torch.device(device).type != "cpu" and not gpu_offload():
        raise InvalidRequestError(
            f"method '{LLAMA_CPP}': this llama-cpp-python build runs on the CPU only, and the "
            f"target runs on {device}; use --device cpu, or reinstall llama-cpp-python with GPU "
            'support (CMAKE_ARGS="-DGGML_CUDA=on" pip install llama-cpp-python)'
        )


def check_gguf(path: Path) -> None:
    """llama.cpp reads GGUF files only; the file's first bytes say whether `path` is one."""
    if path.is_file():
        with path.open("rb") as f:
            if f.read(len(GGUF_MAGIC)) == GGUF_MAGIC:
                return
    what = "a folder" if path.is_dir() else "not a GGUF file"
    raise InvalidRequestError(
        f"method '{LLAMA_CPP}' needs a GGUF model file, and {path} is {what}: pass --model a "
        ".gguf file or a registry name (e.g. smollm2-135m), or leave llama.cpp out of --methods"
    )


def gpu_offload() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


class LlamaCppMethod:
    """The `llama.cpp` method: name, description and generate, like BenchMethod.

    Holds one llama_cpp.Llama, created on the first generation (the runner's warm-up) and created
    again, larger, when a prompt plus max_tokens outgrows its context: eaglespec sizes its cache
    per generation (prompt + max_tokens), so llama.cpp's context stays near that size too instead
    of the model's whole context. Creating it is never inside a timed span."""

    def __init__(self, path: Path, device: torch.device) -> None:
        self.name = LLAMA_CPP
        self.path = path
        self.threads = torch.get_num_threads()  # the threads eaglespec computes with
        self.gpu_layers = -1 if device.type != "cpu" else 0  # all layers, or none
        self.version = llama_cpp_version()
        self.description = (
            f"llama.cpp plain decoding of the same GGUF file (llama-cpp-python {self.version}, "
            f"{self.threads} threads, {'GPU' if self.gpu_layers else 'CPU'}, greedy): a reference "
            "engine with its own kernels; speedup is its tok/s over eaglespec plain's, and its "
            "outputs are compared with plain's but not expected to equal them"
        )
        self.n_ctx = 0  # the current Llama's context; 0 before the first generation
        self._llama: Any = None

    def environment(self) -> dict[str, Any]:
        """results.json's record of what ran."""
        return {
            "package": "llama-cpp-python",
            "version": self.version,
            "n_threads": self.threads,
            "n_gpu_layers": self.gpu_layers,
            "n_ctx": self.n_ctx,
        }

    def _context(self, need: int, limit: int) -> Any:
        """A Llama whose context holds `need` tokens: the next power of two (at least
        MIN_CONTEXT), at most the model's context `limit`."""
        if need > self.n_ctx:
            from llama_cpp import Llama

            if self._llama is not None:
                self._llama.close()  # free the old context before allocating the new one
            n_ctx = min(limit, max(MIN_CONTEXT, 1 << (need - 1).bit_length()))
            self._llama = Llama(
                str(self.path),
                n_ctx=n_ctx,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                n_gpu_layers=self.gpu_layers,
                verbose=False,
            )
            self.n_ctx = n_ctx
        return self._llama

    def generate(
        self, target: LoadedModel, prompt: Sequence[int], params: SamplingParams
    ) -> RequestOutput:
        """One greedy generation of `prompt`'s ids, with eaglespec's stop rules and timings."""
        if params.temperature > 0:
            raise InvalidRequestError(f"method '{LLAMA_CPP}' runs greedy only")
        limit = target.model.cfg.context_limit
        # new_states checks the prompt as eaglespec does; makes the output, text stream, stats.
        seq = new_states([prompt], [params], target.tokenizer, limit, torch.device("cpu"))[0]
        llama = self._context(min(limit, len(prompt) + params.max_tokens), limit)
        eos = set(target.tokenizer.eos_ids)
        llama.reset()  # n_tokens = 0: no prefix match, the KV cache is refilled from position 0
        start = time.perf_counter()
        tokens = llama.generate(list(prompt), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        for i, tid in enumerate(tokens):
            account_time(seq.out.stats, start, time.perf_counter())
            # i tokens already generated sit in the cache behind the prompt (as in generate.py).
            event = append_token(seq, int(tid), eos, len(prompt) + i + 1 >= limit)
            if event.output is not None:
                tokens.close()
                return event.output
        raise RuntimeError("llama.cpp's generator ended before the generation finished")
