"""The public Python API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import torch

from eaglespec.config import ModelConfig, SamplingParams, TreeConfig
from eaglespec.draft.base import Proposer
from eaglespec.draft.proposer import check_min_prob
from eaglespec.engine import generate_speculative
from eaglespec.generate import generate_stream
from eaglespec.methods import (
    DEFAULT_DRAFT_TOKENS,
    compile_proposer,
    make_proposer,
    resolve_method,
    resolve_min_prob,
    speculation_policy,
)
from eaglespec.model.llama import Transformer, check_compile_mode
from eaglespec.model.loader import LoadedModel, load_model
from eaglespec.policy import DraftChoice, DraftPolicy, ScriptedDraft, check_policy_args
from eaglespec.registry import DEFAULT_MODEL, resolve_model
from eaglespec.requests import RequestOutput, StreamEvent, collect_outputs
from eaglespec.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """A loaded target model with its tokenizer.

    `model` is a registry name (pulled on first use), a GGUF file or a Hugging Face folder.
    String prompts get the model's chat template when `chat=True` and the model has one.
    `quant` "int8" / "int4" stores the linear layers as int8 / int4 weights (CPU only; see
    model/quant.py), the target's and the draft's; "int4" keeps the output head at int8,
    "int4-all" makes it int4 too; "w4a8" / "w4a8-all" are the same with activations quantized
    to int8 in eaglespec's own kernel (model/w4a8.py; AVX-512 VNNI CPUs), the fastest CPU
    decode; run it in bfloat16, where speculation over it is tested bitwise lossless (in fp32 a
    verification can flip an int8 activation code that one-token steps do not). `compile`
    "block" / "full" runs the decode and verification steps of the target, of a draft model and
    of an EAGLE-3 head through torch.compile (`compile_steps`): seconds (block) to minutes
    (full) of compiling on first use, then faster steps. `dtype` and `quant` "auto" (the
    commands' default) run a GGUF stored at 4 bits as w4a8 in bfloat16 on a CPU whose kernel
    runs, anything else unquantized in float32 (model/precision.py); `quant` holds the choice.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        quant: str = "auto",
        compile: str = "none",
        progress: bool = True,
        method: str | None = None,
        draft: str | None = None,
        num_draft: int = DEFAULT_DRAFT_TOKENS,
        tree: TreeConfig | None = None,
        capture: Sequence[int] | None = None,
        speculation: str = "adaptive",
        lookup_tokens: int | None = None,
        draft_min_prob: float | None = None,
    ) -> None:
        """The defaults are the commands' (`eaglespec generate`): the model at its file's own
        precision (`dtype` and `quant` "auto": a 4-bit GGUF as w4a8 in bf16 on a CPU with the
        kernel, else as stored; model/precision.py), drafting with the EAGLE-3 head shipped for
        it (if one ships) under adaptive speculation, with prompt lookup grafted in. For the
        exact model decoding plainly: `dtype="float32", quant="none", draft="none"`.

        Speculative decoding: `method` "eagle3" (with `draft` an EAGLE-3 checkpoint folder, or
        "random" for a seeded random head, which tests the mechanics but accepts little; without
        one, the shipped head), "draft-model" (`draft` a smaller model with the same tokenizer),
        "lookup" (prompt n-grams) or "none"; `draft` "none": no draft (methods.resolve_method).
        `num_draft` tokens per round in a chain, or an EAGLE-2 tree of shape `tree` (eagle3
        only); `capture` overrides the head's target layers (boundary indices). `speculation`
        "on" drafts that shape every round, "adaptive" picks each round's chain length (or the
        tree) from measured round times and observed acceptance (policy.py; the policy lives
        with this LLM and keeps learning across calls), "off" decodes plainly. `lookup_tokens`
        (eagle3; default DEFAULT_LOOKUP_TOKENS, 0 for none): each round also verifies up to
        that many prompt-lookup tokens where the context repeats its last tokens
        (draft/hybrid.py). `draft_min_prob` (eagle3; default DEFAULT_DRAFT_MIN_PROB, 0 for
        none) stops a chain where the product of the head's probabilities of its drafts falls
        below it (draft/proposer.py)."""
        method, draft, lookup_tokens = resolve_method(model, method, draft, lookup_tokens)
        draft_min_prob = check_min_prob(resolve_min_prob(method, draft_min_prob))  # before loads
        check_policy_args(speculation, num_draft, tree, has_draft=method != "none")
        self.loaded: LoadedModel = load_model(
            resolve_model(model, progress=progress), dtype=dtype, device=device, quant=quant
        )
        self.method = method
        self.draft, self.compile = draft, compile
        self.quant = self.loaded.precision.quant  # "auto" resolved
        self.num_draft = num_draft
        self.tree = tree
        self.lookup_tokens = lookup_tokens
        self.draft_min_prob = draft_min_prob
        check_compile_mode(compile)  # before the draft loads, not after
        spec = make_proposer(
            self.method,
            draft,
            self.loaded,
            capture=capture,
            quant=self.quant,
            progress=progress,
            lookup_tokens=lookup_tokens,
            min_prob=draft_min_prob,
        )
        self.loaded.model.compile_steps(compile)
        compile_proposer(spec.proposer, compile)
        self.proposer: Proposer | None = spec.proposer
        self.speculation = speculation
        self.policy: DraftPolicy = speculation_policy(speculation, num_draft, tree, self.proposer)
        self.draft_report = spec.report  # one line on the draft, "" for plain decoding

    @property
    def model(self) -> Transformer:
        return self.loaded.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    def encode(self, prompt: Prompt, *, chat: bool = True, system: str | None = None) -> list[int]:
        """Token ids of a prompt: ids pass through, text gets the chat template or BOS handling."""
        if not isinstance(prompt, str):
            return list(prompt)
        if chat and self.tokenizer.chat_template:
            messages = [{"role": "system", "content": system}] if system else []
            return self.tokenizer.encode_chat([*messages, {"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = True,
        policy: DraftPolicy | None = None,
    ) -> Iterator[StreamEvent]:
        """`policy` picks this call's round shapes instead of the LLM's own policy (which then
        neither chooses nor learns from them), and drafts even with speculation "off"."""
        ids, plist = self._requests(prompts, params, chat)
        if self.proposer is None or (self.speculation == "off" and policy is None):
            return generate_stream(self.model, self.tokenizer, ids, plist)
        return generate_speculative(
            self.model,
            self.proposer,
            self.tokenizer,
            ids,
            plist,
            num_draft=self.num_draft,
            tree=self.tree,
            policy=self.policy if policy is None else policy,
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = True,
        policy: DraftPolicy | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order (`policy` as in `stream`)."""
        return collect_outputs(self.stream(prompts, params, chat=chat, policy=policy))

    def chat(
        self, messages: Sequence[Message], params: SamplingParams | None = None
    ) -> RequestOutput:
        ids = self.tokenizer.encode_chat(list(messages))
        return self.generate([ids], params)[0]

    def warm_up(self, prompt: Prompt, batch_sizes: Sequence[int] = (1,)) -> None:
        """Decode `prompt` in every step shape this LLM runs, at each batch size, so first-call
        costs (compiling, under --compile: minutes for "full" the first time) are paid now, not
        mid-generation: plain decoding steps, then one speculative generation that walks one-token
        steps with capture (the adaptive policy's plain arm), the draft head's multi-token
        catch-up they leave pending, a chain of `num_draft` (every verification of T > 1 tokens
        shares its graph) and the tree if one is configured. Batch size 1 and larger batches
        compile separately, and larger batches once with rows of one length and once ragged
        (masked one-token steps). The drafting runs script their shapes: the LLM's policy neither
        chooses nor learns from them. A draft that accepts many tokens can end the short run
        before the last shapes: best effort, not a guarantee."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        chain = DraftChoice(max(1, self.num_draft))
        shapes = [DraftChoice(0), DraftChoice(0), chain]
        if self.tree is not None:
            shapes += [DraftChoice(0), DraftChoice(self.num_draft, self.tree), chain]
        batches = []
        for b in batch_sizes:
            batches.append([ids] * b)  # rows of one length: no attention mask in one-token steps
            if b > 1:  # ragged rows: masked one-token steps, another graph
                batches.append([ids[: max(1, len(ids) - row)] for row in range(b)])
        for rows in batches:
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            collect_outputs(generate_stream(self.model, self.tokenizer, rows, [params] * len(rows)))
            if self.proposer is not None:
                params = SamplingParams(max_tokens=len(shapes) + 1, ignore_eos=True)
                self.generate(rows, params, policy=ScriptedDraft(shapes))

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        chat: bool,
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        single = isinstance(prompts, str) or (
            len(prompts) > 0 and isinstance(prompts[0], int)  # one list of ids
        )
        # mypy cannot narrow the union from the element check above, so the casts state it.
        batch: list[Prompt] = (
            [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        )
        ids = [self.encode(p, chat=chat) for p in batch]
        if params is None:
            params = SamplingParams()
        plist = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(ids):
            raise ValueError(f"{len(ids)} prompts but {len(plist)} SamplingParams")
        return ids, plist
