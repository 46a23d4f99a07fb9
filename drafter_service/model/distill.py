"""`drafter distill-draft`: distil the target's next-token distributions into a small draft model."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import math
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from drafter_service.datasets.loaders import DATASET_NAMES
from drafter_service.model.distill_data import (
    DistillError,
    Source,
    WindowStream,
    check_vocab,
    load_sources,
    pad_batch,
    split_requests,
    windows,
)
from drafter_service.model.draft_model import (
    DraftMeta,
    DraftModelError,
    build_draft_from_target,
    choose_layers,
    decode_step_ms,
    load_draft_model,
    output_vocab_size,
    save_token_counts,
)
from drafter_service.model.hardware import native_bfloat16

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

#: Folder under ``--out`` holding the latest checkpoint (and, for a moment while one is replaced, ``.old``).
CHECKPOINT = "checkpoint"

#: Trainer state inside a checkpoint folder, next to the draft's weights.
TRAINER_STATE = "trainer.pt"

#: Positions whose logits are materialised at once (bounds memory: each is a (chunk, vocab) float32 array).
LOGIT_CHUNK = 128


@dataclass(frozen=True)
class DistillConfig:
    """Settings of one distillation run.

    Attributes:
        target: folder of the target model's checkpoint.
        out: folder for checkpoints and the final draft.
        num_layers: decoder layers of the draft.
        layer_choice: which target layers initialise the draft ("spread" or "first").
        seq_len: tokens per training window.
        batch: windows per step.
        lr: peak AdamW learning rate.
        warmup: steps of linear warm-up.
        schedule: "cosine" (down to 10% of ``lr`` at ``steps``; constant without ``steps``) or "constant".
        steps: stop at this step (counted across resumes).
        minutes: stop after this much training time in this run.
        target_dtype: "bfloat16" or "float32" for the target (the draft trains in float32); "auto": bfloat16
            where ``device`` computes it natively (``native_bfloat16``), float32 elsewhere.
        autocast: run the draft's training matrix products in bfloat16 (weights and optimizer stay float32;
            evaluation is always in float32); None: where ``device`` computes bfloat16 natively.
        eval_requests: requests held out for evaluation.
        checkpoint_every: steps between checkpoints.
        mix: "balanced" (sources take turns) or "pooled" (all windows in one shuffled pool).
        seed: order of requests and windows.
        threads: torch CPU threads (None: torch's default).
        device: where both models run ("cpu", "cuda", ...).
        resume: continue from the checkpoint in ``out``.
        init: folder of an earlier draft to start from instead of the target's layers (adapts a draft to new
            data); it must have ``num_layers`` layers and the target's vocabulary.
    """

    target: str
    out: str
    num_layers: int = 4
    layer_choice: str = "spread"
    seq_len: int = 256
    batch: int = 8
    lr: float = 5e-4
    warmup: int = 10
    schedule: str = "cosine"
    steps: int | None = None
    minutes: float | None = None
    target_dtype: str = "auto"
    autocast: bool | None = None
    eval_requests: int = 20
    checkpoint_every: int = 50
    mix: str = "balanced"
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"
    resume: bool = False
    init: str | None = None

    #: Settings a resumed run must share with its checkpoint.
    RESUME_KEYS = ("num_layers", "layer_choice", "seq_len", "batch", "lr", "warmup", "schedule", "target_dtype",
                   "eval_requests", "mix", "seed", "init")

    def __post_init__(self) -> None:
        if self.steps is None and self.minutes is None:
            raise ValueError("give a budget: --steps and/or --minutes")
        checks = {"num_layers": self.num_layers >= 1, "seq_len": self.seq_len >= 2, "batch": self.batch >= 1,
                  "lr": self.lr > 0, "warmup": self.warmup >= 0, "steps": self.steps is None or self.steps >= 0,
                  "minutes": self.minutes is None or self.minutes >= 0, "eval_requests": self.eval_requests >= 0,
                  "checkpoint_every": self.checkpoint_every >= 1, "threads": self.threads is None or self.threads >= 1,
                  "schedule": self.schedule in ("cosine", "constant"), "mix": self.mix in ("balanced", "pooled"),
                  "target_dtype": self.target_dtype in ("auto", "bfloat16", "float32"),
                  "layer_choice": self.layer_choice in ("spread", "first")}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"bad setting(s): {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")

    def resolved(self, native: bool | None = None) -> DistillConfig:
        """These settings with ``target_dtype="auto"`` and ``autocast=None`` decided for the device.

        Emulated bfloat16 trains many times slower than float32 (each product is converted), so both use
        bfloat16 only where the device computes it natively.

        Args:
            native: whether the device computes bfloat16 natively (default: ``native_bfloat16(self.device)``).
        """
        if self.target_dtype != "auto" and self.autocast is not None:
            return self
        if native is None:
            native = native_bfloat16(self.device)
        dtype = self.target_dtype if self.target_dtype != "auto" else "bfloat16" if native else "float32"
        autocast = native if self.autocast is None else self.autocast
        return dataclasses.replace(self, target_dtype=dtype, autocast=autocast)


@dataclass(frozen=True)
class DistillResult:
    """What a run did: the final draft's metadata (or the checkpoint's state when interrupted)."""

    meta: DraftMeta
    interrupted: bool
    tokens_per_s: float


# -- training ------------------------------------------------------------------------------------------------


def distill_batch(draft: PreTrainedModel, target: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor,
                  train: bool = True, autocast: bool = False) -> tuple[float, int, int]:
    """KL(target || draft) over the real positions of a batch; with ``train`` also the draft's gradients.

    The mean KL's gradient with respect to the draft's logits is ``(softmax(draft) - softmax(target)) / n``,
    applied chunk by chunk so that no more than :data:`LOGIT_CHUNK` rows of full-vocabulary logits exist at once.
    With ``autocast`` the draft's matrix products run in bfloat16 (its weights stay as they are).

    Returns:
        (KL summed over positions, positions where both argmaxes agree, positions).
    """
    import torch
    import torch.nn.functional as F

    ids, mask = ids.to(draft.device), mask.to(draft.device)
    mixed = torch.autocast(draft.device.type, dtype=torch.bfloat16, enabled=autocast)
    with torch.no_grad():
        t_hidden = target.model(ids).last_hidden_state.flatten(0, 1)  # (B*T, H) target dtype
    with torch.set_grad_enabled(train), mixed:
        hidden = draft.model(ids).last_hidden_state  # (B, T, H) float32 (bfloat16 with autocast)
    flat = hidden.detach().flatten(0, 1).requires_grad_(train)  # (B*T, H)
    positions = mask.flatten().nonzero().squeeze(1)  # (n,) int64
    n, kl_sum, agree = int(positions.numel()), 0.0, 0
    for start in range(0, n, LOGIT_CHUNK):
        idx = positions[start:start + LOGIT_CHUNK]
        with torch.no_grad():
            t_logits = target.get_output_embeddings()(t_hidden[idx])  # (c, V) target dtype
            t_logp = torch.log_softmax(t_logits.float(), -1)  # (c, V) float32
        with torch.set_grad_enabled(train), mixed:
            logits = draft.get_output_embeddings()(flat[idx])  # (c, V) float32 (bfloat16 with autocast)
        with torch.no_grad():
            d_logp = torch.log_softmax(logits.float(), -1)
            kl_sum += float(F.kl_div(d_logp, t_logp, reduction="sum", log_target=True))
            agree += int((logits.argmax(-1) == t_logits.argmax(-1)).sum())
        if train:  # in place: (softmax(draft) - softmax(target)) / n
            logits.backward(d_logp.exp_().sub_(t_logp.exp_()).div_(n).to(logits.dtype))
    if train:
        hidden.backward(flat.grad.view_as(hidden))
    return kl_sum, agree, n


def evaluate(draft: PreTrainedModel, target: PreTrainedModel, held: list[Source], seq_len: int, batch: int
             ) -> tuple[float, float, dict[str, float], int]:
    """Top-1 agreement and mean KL on the last ``seq_len`` tokens of every held-out request.

    Returns:
        (agreement, mean KL, agreement per source, positions).
    """
    total = [0.0, 0, 0]
    by_source = {}
    for name, seqs in held:
        tails = [s[-seq_len:] for s in seqs if len(s)]
        part = [0.0, 0, 0]
        for i in range(0, len(tails), batch):
            part = [a + b for a, b in zip(part, distill_batch(draft, target, *pad_batch(tails[i:i + batch]), False),
                                           strict=True)]
        by_source[name] = part[1] / max(part[2], 1)
        total = [a + b for a, b in zip(total, part, strict=True)]
    return total[1] / max(total[2], 1), total[0] / max(total[2], 1), by_source, int(total[2])


def lr_factor(step: int, config: DistillConfig) -> float:
    """Learning-rate multiplier at ``step``: linear warm-up, then cosine to 0.1 at ``config.steps`` or constant."""
    warm = min(1.0, (step + 1) / config.warmup) if config.warmup else 1.0
    if config.schedule == "constant" or not config.steps:
        return warm
    return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step, config.steps) / config.steps)))


def save_checkpoint(out: pathlib.Path, draft: PreTrainedModel, state: dict) -> None:
    """Write the draft and trainer state to ``out/checkpoint`` so that a complete checkpoint always exists.

    The new one is written into a temporary folder; the previous one is moved to ``checkpoint.old`` and
    removed only after the new one is in place (a resume falls back to it if a crash hit in between).
    """
    import torch

    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=out))
    final, old = out / CHECKPOINT, out / f"{CHECKPOINT}.old"
    try:
        draft.save_pretrained(tmp)
        torch.save(state, tmp / TRAINER_STATE)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("checkpoint at step %d in %s", state["step"], final)


def find_checkpoint(out: pathlib.Path) -> pathlib.Path | None:
    """The newest complete checkpoint folder under ``out``, if any."""
    for folder in (out / CHECKPOINT, out / f"{CHECKPOINT}.old"):
        if (folder / TRAINER_STATE).is_file():
            return folder
    return None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event set by the first SIGINT or SIGTERM (a second SIGINT interrupts at once); main thread only."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        logger.warning("signal %d: stopping after this step and saving a checkpoint", signum)
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _start(config: DistillConfig, target: PreTrainedModel, train_windows: int
           ) -> tuple[PreTrainedModel, dict | None]:
    """The draft to train: a fresh one from the target, or the checkpoint's with its trainer state."""
    import torch
    from transformers import AutoModelForCausalLM

    out = pathlib.Path(config.out)
    found = find_checkpoint(out)
    if not config.resume:
        if found is not None:
            raise DistillError(f"{out} already holds a checkpoint; pass --resume to continue it or remove it")
        if config.init is None:
            return build_draft_from_target(target, config.num_layers, config.layer_choice), None
        return _initial_draft(config.init, config.num_layers, output_vocab_size(target)), None
    if found is None:
        raise DistillError(f"no checkpoint in {out} to resume from")
    state = torch.load(found / TRAINER_STATE, map_location="cpu", weights_only=True)
    saved = state["config"]
    if saved["num_layers"] != config.num_layers:
        raise DistillError(f"the checkpoint in {out} has {saved['num_layers']} layers, not {config.num_layers}; "
                           "use the same --layers or another --out")
    changed = [k for k in config.RESUME_KEYS if saved.get(k) != getattr(config, k)]
    if changed:
        raise DistillError("--resume needs the checkpoint's settings; changed: "
                           + ", ".join(f"{k} ({saved.get(k)!r} -> {getattr(config, k)!r})" for k in changed))
    if state["train_windows"] != train_windows:
        raise DistillError(f"the training data differs from the checkpoint's ({train_windows} windows now, "
                           f"{state['train_windows']} then)")
    return AutoModelForCausalLM.from_pretrained(found, dtype=torch.float32), state


def _initial_draft(folder: str, num_layers: int, vocab: int) -> PreTrainedModel:
    """The earlier draft in ``folder`` to continue training, checked against the run's layers and vocabulary."""
    try:
        draft = load_draft_model(folder, vocab_size=vocab)
    except DraftModelError as exc:
        raise DistillError(f"--init: {exc}") from None
    layers = int(draft.config.num_hidden_layers)
    if layers != num_layers:
        raise DistillError(f"--init: the draft in {folder} has {layers} layers, not {num_layers}; "
                           f"pass --layers {layers}")
    return draft


def distill(config: DistillConfig, sources: list[Source], progress: bool = True) -> DistillResult:
    """Train (or continue training) a draft on the sources; write checkpoints and the final draft to ``config.out``.

    Returns:
        The result; when interrupted by a signal only a checkpoint was written.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    if config.threads:
        torch.set_num_threads(config.threads)
    config = config.resolved()
    logger.info("target in %s, draft's products in %s", config.target_dtype,
                "bfloat16 (autocast)" if config.autocast else "float32")
    out = pathlib.Path(config.out)
    target = AutoModelForCausalLM.from_pretrained(config.target, dtype=torch.float32).eval()
    vocab = output_vocab_size(target)
    check_vocab(sources, vocab)
    train_sources, held = split_requests(sources, config.eval_requests, config.seed)
    per_source = [windows(seqs, config.seq_len) for _, seqs in train_sources]
    stream = WindowStream(per_source if config.mix == "balanced" else [sum(per_source, [])], config.seed)
    draft, state = _start(config, target, len(stream))
    target.to(config.device, getattr(torch, config.target_dtype))
    # transformers wraps PreTrainedModel.to with functools.wraps, which type checkers take for an unbound method
    draft.to(config.device, torch.float32)  # type: ignore[arg-type]
    for p in (*draft.get_input_embeddings().parameters(), *draft.get_output_embeddings().parameters()):
        p.requires_grad_(False)  # the target's own vocabulary vectors
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    if state is None:
        before, kl_before, _, _ = evaluate(draft.eval(), target, held, config.seq_len, config.batch)
        state = {"step": 0, "position": 0, "tokens_seen": 0, "agreement_before": before, "kl_before": kl_before,
                 "train_windows": len(stream), "config": {k: getattr(config, k) for k in config.RESUME_KEYS}}
    else:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        logger.info("resuming at step %d", state["step"])

    def checkpoint() -> None:
        save_checkpoint(out, draft, {**state, "optimizer": optimizer.state_dict(),
                                     "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()})

    t0, run_tokens, ema = time.perf_counter(), 0, None
    draft.train()
    with stop_on_signals() as stop, tqdm(total=config.steps, initial=state["step"], desc="distill", unit="step",
                                         disable=not progress, file=sys.stderr) as bar:
        while not stop.is_set() and (config.steps is None or state["step"] < config.steps) and \
                (config.minutes is None or time.perf_counter() - t0 < 60 * config.minutes):
            pos = state["position"]
            ids, mask = pad_batch([stream[g] for g in range(pos, pos + config.batch)])
            kl, agree, n = distill_batch(draft, target, ids, mask, autocast=bool(config.autocast))
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.update(step=state["step"] + 1, position=pos + config.batch, tokens_seen=state["tokens_seen"] + n)
            run_tokens += n
            ema = (kl / n, agree / n) if ema is None else (0.9 * ema[0] + 0.1 * kl / n, 0.9 * ema[1] + 0.1 * agree / n)
            bar.update(1)
            bar.set_postfix(loss=f"{ema[0]:.3f}", agree=f"{ema[1]:.3f}",
                            tok_s=f"{run_tokens / (time.perf_counter() - t0):.0f}")
            if state["step"] % config.checkpoint_every == 0:
                checkpoint()
        seconds = time.perf_counter() - t0
        if state["step"] % config.checkpoint_every or not run_tokens:
            checkpoint()
    tokens_per_s = run_tokens / seconds if seconds > 0 else 0.0
    if stop.is_set():
        meta = DraftMeta(vocab, config.target, config.num_layers, steps=state["step"],
                         tokens_seen=state["tokens_seen"], agreement_before=state["agreement_before"])
        return DistillResult(meta, True, tokens_per_s)
    save_token_counts(config.out, [seq for _, seqs in train_sources for seq in seqs], vocab, config.init)
    return DistillResult(_finish(config, draft.eval(), target, held, state, vocab), False, tokens_per_s)


def _finish(config: DistillConfig, draft: PreTrainedModel, target: PreTrainedModel, held: list[Source],
            state: dict, vocab: int) -> DraftMeta:
    """Evaluate and time the trained draft, then save it with its metadata into ``config.out``."""
    import torch

    after, kl_after, by_source, n_eval = evaluate(draft, target, held, config.seq_len, config.batch)
    draft_ms, target_ms = {}, {}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        draft_ms[name] = decode_step_ms(copy.deepcopy(draft).to(dtype))
        target_ms[name] = decode_step_ms(target if target.dtype == dtype else copy.deepcopy(target).to(dtype))
    draft.save_pretrained(config.out)
    earlier = DraftMeta.read(config.init) if config.init else None
    layers = earlier.source_layers if earlier is not None else choose_layers(
        target.config.num_hidden_layers, config.num_layers, config.layer_choice)
    meta = DraftMeta(vocab, config.target, config.num_layers, source_layers=layers, initial_draft=config.init or "",
                     steps=state["step"], tokens_seen=state["tokens_seen"], agreement_before=state["agreement_before"],
                     agreement_after=after, agreement_by_source=by_source, eval_tokens=n_eval,
                     draft_step_ms=draft_ms, target_step_ms=target_ms,
                     kl_before=state["kl_before"], kl_after=kl_after)
    return meta.write(config.out)


# -- command line --------------------------------------------------------------------------------------------


def add_distill_command(sub: argparse._SubParsersAction) -> None:
    """Register ``distill-draft``."""
    d = DistillConfig.__dataclass_fields__
    p = sub.add_parser("distill-draft", help="train a small draft model from stored requests (distillation "
                       "on the target's logits)")
    p.add_argument("--out", required=True, help="folder for checkpoints and the final draft")
    p.add_argument("--target", help="target checkpoint folder (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--layers", type=int, default=d["num_layers"].default, help="decoder layers of the draft")
    p.add_argument("--layer-choice", choices=("spread", "first"), default="spread",
                   help="target layers that initialise the draft's: evenly spread (first and last included) "
                   "or the first ones")
    data = p.add_argument_group("data (at least one source)")
    data.add_argument("--redis-url", help="read the stored requests of --namespace from this Redis (redis://, "
                      "rediss://, unix://, redis+sentinel:// or redis+cluster://, as drafter serve takes it)")
    data.add_argument("--data-dir", help="read them from a `drafter serve --data-dir` folder (starts its "
                      "embedded Redis; not while a server uses the folder)")
    data.add_argument("--namespace", default="default", help="namespace for --redis-url / --data-dir")
    data.add_argument("--tokens", action="append", default=[], help="request JSONL file (repeatable)")
    data.add_argument("--dataset", action="append", default=[], choices=DATASET_NAMES,
                      help="a built-in data set, tokenized with SmolLM2's tokenizer (repeatable)")
    data.add_argument("--limit", type=int, help="requests per data set (default: each set's own)")
    data.add_argument("--skip", type=int, default=0,
                      help="requests skipped first in each data set (keeps a replay's requests out of training)")
    data.add_argument("--mix", choices=("balanced", "pooled"), default="balanced",
                      help="sources take turns (balanced) or share one pool of windows (pooled)")
    data.add_argument("--eval-requests", type=int, default=d["eval_requests"].default,
                      help="requests held out to measure agreement, taken from the sources in turn")
    tr = p.add_argument_group("training")
    tr.add_argument("--steps", type=int, help="stop at this step (counted across resumes)")
    tr.add_argument("--minutes", type=float, help="stop after this many minutes of training in this run")
    tr.add_argument("--seq-len", type=int, default=d["seq_len"].default, help="tokens per window")
    tr.add_argument("--batch", type=int, default=d["batch"].default, help="windows per step")
    tr.add_argument("--lr", type=float, default=d["lr"].default, help="peak AdamW learning rate")
    tr.add_argument("--warmup", type=int, default=d["warmup"].default, help="warm-up steps")
    tr.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                    help="after warm-up: cosine to 10%% at --steps (constant without --steps), or constant")
    tr.add_argument("--target-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="dtype of the target; auto: bfloat16 where the device computes it natively (CUDA, "
                    "or a CPU with AVX512-BF16 or AMX), else float32, since emulated bfloat16 trains many "
                    "times slower")
    tr.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                    help="draft's training matrix products in bfloat16 (weights and optimizer stay float32; "
                    "default: where the device computes bfloat16 natively)")
    tr.add_argument("--threads", type=int, help="torch CPU threads")
    tr.add_argument("--device", default="cpu", help="where both models run (cpu, cuda, cuda:N)")
    tr.add_argument("--seed", type=int, default=0, help="order of requests and windows")
    tr.add_argument("--checkpoint-every", type=int, default=d["checkpoint_every"].default,
                    help="steps between checkpoints")
    tr.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    tr.add_argument("--init", help="start from this earlier draft's weights instead of the target's layers "
                    "(adapts a draft to new data, such as a deployment's own requests); --layers must match it")
    p.set_defaults(func=run_distill)


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    """The DistillConfig described by ``distill-draft``'s flags."""
    if args.target is None:
        from drafter_service.datasets.target_model import smollm2_checkpoint

        args.target = str(smollm2_checkpoint())
    return DistillConfig(
        target=args.target, out=args.out, num_layers=args.layers, layer_choice=args.layer_choice,
        seq_len=args.seq_len, batch=args.batch, lr=args.lr, warmup=args.warmup, schedule=args.schedule,
        steps=args.steps, minutes=args.minutes, target_dtype=args.target_dtype, autocast=args.autocast,
        eval_requests=args.eval_requests,
        checkpoint_every=args.checkpoint_every, mix=args.mix, seed=args.seed, threads=args.threads,
        device=args.device, resume=args.resume, init=args.init)


def run_distill(args: argparse.Namespace) -> int:
    """Train, then print agreement before and after, decoding-step times and training speed."""
    from store.embedded_redis import EmbeddedRedisError
    from store.persistence import PersistenceError

    try:
        config = config_from_args(args)
        sources = load_sources(args.redis_url, args.data_dir, args.namespace, args.tokens, args.dataset, args.limit,
                               args.skip)
        result = distill(config, sources)
    except (ValueError, OSError, PersistenceError, EmbeddedRedisError) as exc:  # bad settings, data or storage
        raise SystemExit(f"distill-draft: {exc}") from None
    m = result.meta
    if result.interrupted:
        print(f"interrupted at step {m.steps} ({m.tokens_seen} tokens seen); checkpoint saved in "
              f"{pathlib.Path(config.out) / CHECKPOINT}; continue with --resume")
        return 130
    print(f"draft: {m.num_layers} layers (from target layers {m.source_layers}), {m.steps} steps, "
          f"{m.tokens_seen} tokens seen, {result.tokens_per_s:.0f} tokens/s in this run")
    print(f"top-1 agreement on {m.eval_tokens} held-out positions: {m.agreement_before:.3f} -> "
          f"{m.agreement_after:.3f} (KL {m.kl_before:.3f} -> {m.kl_after:.3f})")
    for name, value in m.agreement_by_source.items():
        print(f"  {name}: {value:.3f}")
    for name, ms in m.draft_step_ms.items():
        print(f"decoding step ({name}, batch 1, KV cache): draft {ms:.1f} ms, target {m.target_step_ms[name]:.1f} ms")
    print(f"saved to {config.out}")
    return 0
