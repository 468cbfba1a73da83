"""`eaglespec train`: prompts -> target-regenerated responses -> captured features -> draft
vocabulary -> training-time-test training -> native EAGLE-3 checkpoint -> held-out acceptance with
the real decoder. Every stage caches its result under OUT/work, so rerunning the command after a
stop picks up where it ended, and the same command reproduces a head from scratch.

Under `torchrun` (WORLD_SIZE > 1) rank 0 regenerates and captures while the others wait; all ranks
train (trainer.py's exact gradient split); rank 0 writes and evaluates the head.
"""

from __future__ import annotations

import json
import os
import platform
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from eaglespec.config import SamplingParams
from eaglespec.draft.config import DraftConfig, resolve_capture_layers
from eaglespec.draft.eagle3 import Eagle3Head
from eaglespec.draft.loader import LoadedDraft, load_eagle3, save_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.errors import InvalidRequestError
from eaglespec.model.loader import LoadedModel, load_model, parse_dtype
from eaglespec.model.quant import dense_rows
from eaglespec.registry import resolve_model
from eaglespec.requests import collect_outputs
from eaglespec.train.data import read_all, with_variants
from eaglespec.train.features import (
    FeatureShard,
    FeatureSink,
    capture_features,
    captured_keys,
    load_shard,
    shard_paths,
)
from eaglespec.train.meter import NEVER, Deadline, Meter
from eaglespec.train.regen import (
    RegenConfig,
    Sample,
    read_jsonl,
    read_samples,
    regenerate,
    turns_to_answer,
)
from eaglespec.train.synth import (
    FOLLOWUP_TEMPERATURE,
    FOLLOWUP_TOP_P,
    SynthConfig,
    completion_prompts,
    followup_prompts,
    summary_prompts,
    synthesize_prompts,
)
from eaglespec.train.trainer import (
    StepStats,
    TrainConfig,
    autocast_dtype,
    evaluate,
    train,
    world,
)
from eaglespec.train.vocab import DraftVocab, build_draft_vocab, target_ids

STAGES = ("regen", "features", "train", "eval")
Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    target: str  # registry name, GGUF file or HF folder
    data: tuple[str, ...]  # prompt files (see data.py for the formats)
    out: Path
    variants: tuple[tuple[str, float], ...] = ()  # (name, share) prompt recasts, data.VARIANTS
    limit_per_file: int | None = None  # first N conversations of each file (after the skipped)
    skip_per_file: int = 0  # conversations skipped at the start of each file
    synth: SynthConfig = field(default_factory=SynthConfig)  # self-asked prompts (synth.py)
    regen: RegenConfig = field(default_factory=RegenConfig)
    summaries: int = 0  # "Summarize: <answer>" prompts over the target's own long answers
    summary_min_tokens: int = 150  # answers at least this long are summarized
    summary_join: int = 1  # each text to summarise joins 1 to this many answers
    completions: int = 0  # "Complete the code I provided." over the target's own functions
    followups: int = 0  # second user turns the target writes after its own answers, answered
    init_from: Path | None = None  # a head to continue training (weights; see keep_vocab)
    draft_vocab: int = 8192  # 0 or >= the target's vocab: full vocabulary
    keep_vocab: bool = False  # continuing: the head's own tokens first, then the most frequent
    head_intermediate: int | None = None  # the head's MLP width; None: the target's
    lm_head: str = "trained"  # "target": the target's rows of the draft vocabulary, frozen
    capture: tuple[int, ...] | None = None  # boundary ids; default (2, N//2, N-3)
    # The target for answering, capture and the held-out evaluation, at the precision the
    # commands run it ("auto": a 4-bit GGUF as w4a8 in bf16), so the head learns the states and
    # greedy choices of the model that verifies its drafts.
    target_dtype: str = "auto"
    target_quant: str = "auto"
    device: str = "cpu"
    heldout: float = 0.02  # share of conversations held out (by source, never trained on)
    eval_prompts: int = 24  # held-out prompts decoded with the real engine at the end
    eval_max_tokens: int = 128
    eval_draft_tokens: int = 4
    save_dtype: str = "bfloat16"
    stop_after: str = "eval"  # one of STAGES
    train: TrainConfig = field(default_factory=TrainConfig)


def run(cfg: PipelineConfig, log: Log = print, progress: bool = True) -> dict[str, Any]:
    """Run the stages up to `cfg.stop_after`; returns (and writes to OUT/train_report.json) the
    report: data, vocabulary, training curve, held-out acceptance, times."""
    if cfg.stop_after not in STAGES:
        raise ValueError(f"stop_after must be one of {STAGES}")
    _init_distributed(cfg.device)
    rank, size = world()
    work = cfg.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"config": _jsonable(asdict(cfg)), "world_size": size}
    times: dict[str, float] = {}
    rates: dict[str, dict[str, Any]] = {}  # each stage's throughput (meter.py)
    target = load_model(
        resolve_model(cfg.target, progress=progress and rank == 0),
        dtype=cfg.target_dtype,
        quant=cfg.target_quant,
        device=cfg.device,
    )
    report["target_precision"] = asdict(target.precision)
    log(f"target: {target.precision.dtype} {target.precision.quant}")
    tcfg = target.config
    capture = resolve_capture_layers(DraftConfig.like_target(tcfg), tcfg.num_layers, cfg.capture)
    report["capture"] = list(capture)
    # The head to continue is loaded and checked before regeneration, not after an hour of it.
    init = load_eagle3(cfg.init_from, target.model) if cfg.init_from else None
    if init is not None:
        check_init_capture(init, capture)
        if cfg.keep_vocab:
            check_init_vocab(init, cfg.draft_vocab, tcfg.vocab_size)

    t = time.perf_counter()
    if rank == 0:
        convs = read_all(cfg.data, cfg.skip_per_file, cfg.limit_per_file)
        convs = with_variants(convs, dict(cfg.variants))
        if cfg.synth.prompts:
            have = len(read_jsonl(work / "synth_prompts.jsonl"))
            meter = Meter("synth", "prompts", log, total=cfg.synth.prompts, done=have)
            synth = synthesize_prompts(
                target.model,
                target.tokenizer,
                work / "synth_prompts.jsonl",
                cfg.synth,
                on_batch=meter.add,
                deadline=Deadline.after(cfg.synth.max_seconds),
            )
            rates["synth"] = meter.result()
            report["synth_prompts"] = len(synth)
            convs += synth
        log(f"regen: {len(convs)} conversations, {sum(len(c.turns) for c in convs)} user turns")
        responses = work / "responses.jsonl"
        meter = Meter("regen", "turns", log)
        # greedy answers bring their features with them (recorder.py): no prefill over them later
        sink = FeatureSink(work / "features", capture) if cfg.regen.temperature == 0 else None
        # the turns this run answers: a resumed run's earlier answers are not planned again (they
        # would enlarge the first round's share of the budget at the second round's cost)
        answered = {s.key for s in read_samples(responses)}
        planned = turns_to_answer(convs, answered)
        if cfg.regen.max_samples is not None:
            planned = min(planned, max(0, cfg.regen.max_samples - len(answered)))
        prompts_due, extra_due = regen_deadlines(
            cfg.regen.max_seconds, planned, cfg.summaries + cfg.completions + cfg.followups
        )
        summary = regenerate(
            target.model,
            target.tokenizer,
            convs,
            responses,
            cfg.regen,
            on_batch=meter.add,
            features=sink,
            deadline=prompts_due,
        )
        extra, completions, followups = [], [], []
        if cfg.summaries or cfg.completions or cfg.followups:
            answers = read_samples(responses)
            extra = summary_prompts(
                target.tokenizer,
                answers,
                cfg.summaries,
                cfg.summary_min_tokens,
                cfg.regen.seed,
                cfg.summary_join,
            )
            log(f"regen: {len(extra)} summaries of the target's own answers")
            completions = completion_prompts(
                target.tokenizer, answers, cfg.completions, cfg.regen.seed
            )
            log(f"regen: {len(completions)} completions of the target's own code")
        if cfg.followups:
            have = len(read_jsonl(work / "followups.jsonl"))
            meter_f = Meter("followups", "prompts", log, total=cfg.followups, done=have)
            followups = followup_prompts(
                target.model,
                target.tokenizer,
                convs,
                answers,
                work / "followups.jsonl",
                cfg.followups,
                replace(cfg.synth, temperature=FOLLOWUP_TEMPERATURE, top_p=FOLLOWUP_TOP_P),
                on_batch=meter_f.add,
                # writing may take half the time left, answering the rest (stage 34's second
                # call, writing until its budget's end, answered 16 of its derived prompts)
                deadline=extra_due.halfway(),
            )
            rates["followups"] = meter_f.result()
            report["followups"] = len(followups)
            log(f"regen: {len(followups)} follow-ups to the target's own answers")
        if extra or completions or followups:  # none where no answer is long enough, ...
            uncapped = replace(cfg.regen, max_samples=None)
            first = summary
            summary = regenerate(
                target.model,
                target.tokenizer,
                extra + completions + followups,
                responses,
                uncapped,
                on_batch=meter.add,
                features=sink,
                deadline=extra_due,
            )
            summary = replace(
                summary,
                new=first.new + summary.new,
                skipped_long=first.skipped_long + summary.skipped_long,
            )
        rates["regen"] = meter.result()
        report["regen"] = asdict(summary)
        report["features_while_answering"] = 0 if sink is None else sink.samples
        if sink is not None:
            log(f"regen: features of {sink.samples} answers taken while answering")
        log(f"regen: {summary.samples} responses, {summary.response_tokens} tokens")
    _barrier()
    times["regen"] = time.perf_counter() - t
    if cfg.stop_after == "regen":
        return _finish(cfg, report, times, rates)

    samples = read_samples(work / "responses.jsonl")
    train_s, held_s = split_heldout(samples, cfg.heldout)
    size_v = cfg.draft_vocab if 0 < cfg.draft_vocab < tcfg.vocab_size else tcfg.vocab_size
    # --keep-vocab: a continued head keeps its tokens (and their trained rows); the rest by
    # frequency
    kept = target_ids(init.head.d2t) if init is not None and cfg.keep_vocab else []
    vocab = build_draft_vocab([s.response for s in train_s], size_v, tcfg.vocab_size, kept)
    report["data"] = {
        "samples": len(samples),
        "train_samples": len(train_s),
        "heldout_samples": len(held_s),
        "train_response_tokens": sum(len(s.response) for s in train_s),
        "draft_vocab": len(vocab.ids),
        "heldout_vocab_coverage": vocab.coverage(t for s in held_s for t in s.response),
    }
    log(f"data: {json.dumps(report['data'])}")

    t = time.perf_counter()
    if rank == 0:
        have = len(captured_keys(work / "features") & {s.key for s in samples})
        meter = Meter("features", "samples", log, total=len(samples), done=have)
        capture_features(target.model, samples, capture, work / "features", on_batch=meter.add)
        rates["features"] = meter.result()
    _barrier()
    times["features"] = time.perf_counter() - t
    if cfg.stop_after == "features":
        return _finish(cfg, report, times, rates)

    t = time.perf_counter()
    shards = [load_shard(p) for p in shard_paths(work / "features")]
    by_key = {k: s.sample(i) for s in shards for i, k in enumerate(s.keys)}
    train_f = [by_key[s.key] for s in train_s if s.key in by_key]
    held_f = [by_key[s.key] for s in held_s if s.key in by_key]
    # (Vd, Ct) the target's output rows of the draft vocabulary, unpacked without the whole head
    target_rows = dense_rows(target.model.lm_head, vocab.ids)
    head = build_head(
        target,
        target_rows,
        vocab,
        len(capture),
        cfg.device,
        intermediate_size=cfg.head_intermediate,
        lm_head=cfg.lm_head,
    )
    if init is not None:
        rows = init_head(head, init, capture)
        rows_note = (
            "its lm_head the target's own rows, frozen"
            if head.lm_head_is_target_rows
            else f"{rows} of {len(vocab.ids)} lm_head rows carried over; the rest start from "
            "the target's, mapped onto its scale"
        )
        log(f"train: continuing from the head in {cfg.init_from} ({rows_note})")
    amp = autocast_dtype(cfg.train.dtype, torch.device(cfg.device))
    report["train_dtype"] = amp
    log(f"train: the head's matmuls in {amp} (--train-dtype {cfg.train.dtype})")
    curve: list[dict[str, Any]] = []
    heldout_curve: list[dict[str, Any]] = []
    meter = Meter("train", "steps", log, every=60.0)
    history = train(
        head,
        train_f,
        vocab,
        target_rows,
        cfg.train,
        checkpoint=work / "checkpoint.pt",
        on_step=_step_logger(log, curve, meter, cfg.train.ttt_steps),
        on_epoch=_epoch_eval(log, heldout_curve, head, held_f, vocab, target_rows, cfg),
        deadline=Deadline.after(cfg.train.max_seconds),
    )
    times["train"] = time.perf_counter() - t
    rates["train"] = {**meter.result(), "tokens_are": "positions x unrolled steps"}
    report["train"] = {"steps": len(history), "curve": curve, "heldout": heldout_curve}
    if rank == 0:
        save_eagle3(
            head,
            cfg.out,
            capture,
            num_target_layers=tcfg.num_layers,
            dtype=parse_dtype(cfg.save_dtype),
        )
        log(f"saved the head to {cfg.out}")
    if cfg.stop_after == "train" or rank != 0:
        return _finish(cfg, report, times, rates)

    t = time.perf_counter()
    report["heldout_acceptance"] = heldout_acceptance(cfg, target, held_s, log)
    times["eval"] = time.perf_counter() - t
    return _finish(cfg, report, times, rates)


def regen_deadlines(
    seconds: float | None, planned: int, extra: int, clock: Callable[[], float] = time.monotonic
) -> tuple[Deadline, Deadline]:
    """`--regen-seconds` split between the two rounds of answering: the first (the prompts) may
    use the share of `seconds` that its `planned` turns are of all turns planned, the summaries
    and completions (`extra`, written over the first round's answers) the rest. A first round
    allowed the whole budget left none for them (stage 13 answered no summary)."""
    if seconds is None:
        return NEVER, NEVER
    share = planned / max(1, planned + extra)
    return Deadline.after(seconds * share, clock), Deadline.after(seconds, clock)


def split_heldout(samples: Sequence[Sample], share: float) -> tuple[list[Sample], list[Sample]]:
    """Held out by conversation (all turns of one together), by a stable hash of its source."""
    train_s: list[Sample] = []
    held_s: list[Sample] = []
    for s in samples:
        source = s.key.rsplit("#", 1)[0]
        (held_s if zlib.crc32(source.encode()) % 10_000 < share * 10_000 else train_s).append(s)
    return train_s, held_s


def build_head(
    target: LoadedModel,
    target_rows: torch.Tensor,  # (Vd, Ct) the target's output rows of the vocabulary
    vocab: DraftVocab,
    num_aux: int,
    device: str,
    *,
    intermediate_size: int | None = None,
    lm_head: str = "trained",
) -> Eagle3Head:
    """A fresh fp32 head shaped like the target (its MLP `intermediate_size` wide where given):
    the target's embedding (frozen, an fp32 copy), lm_head initialised from the target's rows of
    the draft vocabulary and `norm` from the target's final norm (the head starts out reading
    its state the way the target does). `lm_head` "target" keeps those rows frozen: the head is
    saved without them and gathers them from the target at load (a head a fraction the size)."""
    if lm_head not in LM_HEADS:
        raise InvalidRequestError(f"lm_head must be one of {', '.join(LM_HEADS)}, not {lm_head!r}")
    model = target.model
    dcfg = DraftConfig.like_target(
        target.config, draft_vocab_size=len(vocab.ids), intermediate_size=intermediate_size
    )
    embed = nn.Embedding(*model.embed.weight.shape).requires_grad_(False)
    embed.weight.data.copy_(model.embed.weight.detach().float())
    torch.manual_seed(0)
    head = Eagle3Head(dcfg, num_aux, embed=embed).to(device)
    head.shares_embed = True  # the target's embedding: never saved with the head
    with torch.no_grad():
        assert isinstance(head.lm_head, nn.Linear) and head.norm is not None
        head.lm_head.weight.copy_(target_rows.float())
        head.norm.weight.copy_(model.norm.weight.detach().float())
        head.d2t.copy_(vocab.d2t)
    if lm_head == "target":
        head.lm_head.requires_grad_(False)
        head.lm_head_is_target_rows = True
    return head


def check_init_capture(init: LoadedDraft, capture: Sequence[int]) -> None:
    if tuple(init.capture) != tuple(capture):
        raise InvalidRequestError(
            f"--init-from: the head to continue captures layers {list(init.capture)}, this run "
            f"{list(capture)} (pass --capture to match)"
        )


def check_init_vocab(init: LoadedDraft, size: int, vocab_size: int) -> None:
    """The continued head's tokens must fit the run's draft vocabulary (build_draft_vocab keeps
    them all)."""
    own = len(init.head.d2t)
    if 0 < size < vocab_size and own > size:
        raise InvalidRequestError(
            f"--init-from: the head to continue drafts {own} tokens, more than --draft-vocab "
            f"{size} (it keeps its tokens: pass --draft-vocab {own} or more)"
        )


LM_HEADS = ("trained", "target")


def init_head(head: Eagle3Head, init: LoadedDraft, capture: Sequence[int]) -> int:
    """Continue a saved head: its weights become `head`'s fp32 master weights (the embedding
    stays the target's). `head` has its own draft vocabulary (this run's most frequent tokens,
    after the saved head's own with --keep-vocab): the lm_head rows of tokens in both continue
    from the saved head.

    The other rows cannot simply keep build_head's start (the target's rows): the saved head's
    norm and layer were trained against its own rows, and the target's rows then win almost
    every argmax (measured: held-out top-1 0.06% with them against 39% with those rows zeroed).
    They start instead from the target's rows mapped by the least-squares linear map W_target @ A
    ~= W_saved fitted on the carried rows, so new tokens score on the saved head's scale.
    Returns how many rows continued."""
    check_init_capture(init, capture)
    own = {
        k: v.float() if v.is_floating_point() else v
        for k, v in init.head.state_dict().items()
        if not k.startswith(("embed.", "lm_head.")) and k != "d2t"
    }
    head.load_state_dict(own, strict=False)
    if head.lm_head_is_target_rows:  # the target's rows, whatever the saved head held
        return 0
    old_ids = target_ids(init.head.d2t)  # old row -> target id
    new_ids = target_ids(head.d2t)
    new_row = {t: i for i, t in enumerate(new_ids)}
    pairs = [(new_row[t], i) for i, t in enumerate(old_ids) if t in new_row]
    assert isinstance(head.lm_head, nn.Linear)
    saved_w = init.head.lm_head.weight
    assert isinstance(saved_w, torch.Tensor)
    if not pairs:
        return 0
    weight = head.lm_head.weight  # (Vd, C) the target's rows (build_head)
    dst = torch.tensor([a for a, _ in pairs], device=weight.device)
    src = torch.tensor([b for _, b in pairs])
    saved = saved_w.detach()[src.to(saved_w.device)].to(weight.device, torch.float64)  # (P, C)
    with torch.no_grad():
        fresh = torch.ones(len(weight), dtype=torch.bool, device=weight.device)
        fresh[dst] = False
        if bool(fresh.any()):  # host sync, once
            base = weight.detach()[dst].double()  # (P, C) the target's rows of carried tokens
            A = torch.linalg.lstsq(base, saved).solution  # (C, C)
            weight[fresh] = (weight.detach()[fresh].double() @ A).float()
        weight[dst] = saved.float()
    return len(pairs)


def heldout_acceptance(
    cfg: PipelineConfig, target: LoadedModel, held: Sequence[Sample], log: Log
) -> dict[str, Any]:
    """Greedy chain decoding of held-out first turns with the saved head on the target as the
    pipeline loaded it (the commands' precision by default), as `eaglespec generate --draft OUT`
    runs it: tokens per target forward (the bonus included)."""
    prompts = [s.prompt for s in held if s.key.endswith("#0")][: cfg.eval_prompts]
    if not prompts:
        return {"prompts": 0}
    loaded = load_eagle3(cfg.out, target.model)
    proposer = Eagle3Proposer(loaded.head, loaded.capture)
    params = SamplingParams(max_tokens=cfg.eval_max_tokens)
    outs = []
    for p in prompts:  # one at a time: batch padding must not enter the timing
        outs += collect_outputs(
            generate_speculative(
                target.model,
                proposer,
                target.tokenizer,
                [p],
                [params],
                num_draft=cfg.eval_draft_tokens,
            )
        )
    rounds = sum(o.stats.rounds for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    result = {
        "prompts": len(outs),
        "draft_tokens": cfg.eval_draft_tokens,
        "max_tokens": cfg.eval_max_tokens,
        "rounds": rounds,
        "mean_accept_length": (accepted + rounds) / max(rounds, 1),
        "per_prompt": [round(o.stats.mean_accept_length, 3) for o in outs],
    }
    log(
        f"held-out acceptance: {result['mean_accept_length']:.2f} tokens per target forward "
        f"(chain of {cfg.eval_draft_tokens}, {len(outs)} prompts)"
    )
    return result


def _step_logger(
    log: Log, curve: list[dict[str, Any]], meter: Meter, ttt_steps: int
) -> Callable[[StepStats], None]:
    rank, _ = world()

    def on_step(s: StepStats) -> None:
        meter.add(1, s.positions * ttt_steps)
        curve.append(
            {
                "step": s.step,
                "epoch": s.epoch,
                "loss": round(s.loss, 4),
                "lr": s.lr,
                "acc": [round(a, 3) for a in s.acc],
                "accept_proxy": round(s.accept_proxy, 3),
            }
        )
        if rank == 0 and s.step % 20 == 0:
            log(
                f"step {s.step} epoch {s.epoch} loss {s.loss:.3f} acc0 {s.acc[0]:.3f} "
                f"proxy {s.accept_proxy:.2f} lr {s.lr:.2e}"
            )

    return on_step


def _epoch_eval(
    log: Log,
    curve: list[dict[str, Any]],
    head: Eagle3Head,
    held: Sequence[FeatureShard],
    vocab: DraftVocab,
    target_rows: torch.Tensor,
    cfg: PipelineConfig,
) -> Callable[[int], None]:
    """Held-out training-time-test metrics after each epoch (rank 0)."""

    def on_epoch(epoch: int) -> None:
        if world()[0] != 0:
            return
        m = evaluate(head, held, vocab, target_rows, cfg.train)
        curve.append({"epoch": epoch, **m})
        if m:
            log(f"epoch {epoch} held-out: acc {m['acc'][:4]} proxy {m['accept_proxy']:.2f}")

    return on_epoch


def _init_distributed(device: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _finish(
    cfg: PipelineConfig,
    report: dict[str, Any],
    times: dict[str, float],
    rates: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    report["seconds"] = {k: round(v, 1) for k, v in times.items()}
    report["throughput"] = rates
    report["environment"] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": cfg.device,
        "machine": platform.machine(),
        "processor": platform.processor(),
    }
    if world()[0] == 0:
        (cfg.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x
