"""A reference engine on torch + transformers: draft, verify the tree in one forward pass, keep the accepted path."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from drafter_service.api.verify_budget import VerifyBudget
from engine_client.draft_source import EMPTY_TREE, DraftSource, DraftTree, NoDrafts
from engines.reference.kv_cache import keep_block_entries, new_cache, returned_cache, trim_to_windows, with_cache
from engines.reference.tree_attention import model_tree_mask, tree_positions
from engines.reference.verification import Verdict, greedy_verify, sample_verify

logger = logging.getLogger(__name__)

__all__ = ["StepStats", "GenerationResult", "ReferenceEngine", "default_device", "greedy_reference"]


@dataclass(frozen=True)
class StepStats:
    """One decoding step.

    Attributes:
        drafted: draft nodes verified (after truncation to ``max_nodes``).
        accepted: draft nodes accepted (the step emitted ``accepted + 1`` tokens before any final truncation).
        seconds: wall time of the whole step, drafting included.
        draft_seconds: the part of ``seconds`` spent waiting for the draft source.
    """

    drafted: int
    accepted: int
    seconds: float
    draft_seconds: float

    @property
    def verify_seconds(self) -> float:
        """Time of the forward pass, verification and cache upkeep."""
        return self.seconds - self.draft_seconds


@dataclass(frozen=True)
class GenerationResult:
    """What ``generate`` produced.

    Attributes:
        tokens: the generated tokens (the prompt excluded), at most ``max_new_tokens``.
        steps: one entry per forward pass after the prefill.
    """

    tokens: list[int]
    steps: list[StepStats] = field(default_factory=list)


def default_device(model: torch.nn.Module | None = None) -> torch.device:
    """Where to run: the model's device when it is already on an accelerator, else CUDA when available, else CPU."""
    if model is not None:
        param = next(model.parameters(), None)
        if param is not None and param.device.type != "cpu":
            return param.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(t) for t in eos_token_id)


class ReferenceEngine:
    """Speculative decoding of one request at a time with a transformers causal LM (batch 1, DynamicCache).

    Drafting off (``NoDrafts``) and on take the same path: an empty tree is a plain one-token step.
    """

    def __init__(self, model: torch.nn.Module, draft_source: DraftSource | None = None, max_nodes: int = 32,
                 device: torch.device | str | None = None, adaptive: bool = False, min_nodes: int = 0,
                 budget: VerifyBudget | None = None) -> None:
        """Set up the engine.

        Args:
            model: a transformers ``*ForCausalLM`` (Llama-family or Gemma-3 text); moved to ``device``.
            draft_source: where drafts come from; None for no drafting.
            max_nodes: most draft nodes verified per step (longer trees are cut with ``DraftTree.prefix``).
            device: where to run; None picks ``default_device(model)``.
            adaptive: verify only the leading nodes that maximise expected tokens per second (none when drafting
                does not pay), from the tree's acceptance estimates, calibrated against what was accepted, and the
                step time measured at each size (``VerifyBudget``).
            min_nodes: with ``adaptive``, verify at least this many nodes.
            budget: the rule and what it learned (kept across requests; a new one by default). It also measures
                the step times the draft source is told about when ``adaptive`` is off.
        """
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        self.device = torch.device(device) if device is not None else default_device(model)
        self.model = model.to(self.device).eval()
        self.config = model.config
        self.dtype = next(model.parameters()).dtype
        self.draft_source: DraftSource = draft_source if draft_source is not None else NoDrafts()
        self.max_nodes = max_nodes
        self.adaptive = adaptive
        self.budget = budget if budget is not None else VerifyBudget(min_nodes=min_nodes)

    def _forward(self, input_ids: list[int], cache: Any, mask: Any = None,
                 positions: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)  # (1, q) int64
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(self.model, cache),
                         use_cache=True, logits_to_keep=logits_to_keep)
        return out.logits[0]  # (q or logits_to_keep, V)

    def _verify(self, logits: torch.Tensor, tree: DraftTree, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> Verdict:
        if temperature <= 0.0:
            return greedy_verify(logits, tree.token_ids, tree.parents)
        return sample_verify(logits, tree.token_ids, tree.parents, temperature=temperature, top_k=top_k,
                             top_p=top_p, generator=generator, draft_probs=getattr(tree, "draft_probs", None) or None)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

        A tree may carry ``draft_probs`` ((n,) per node the (V,) distribution its token was sampled from, or None
        for a deterministic guess); sampling verification then uses them. Without them (or once ``prefix`` cut the
        tree) every node is verified as a one-hot proposal, which is lossless for any proposal, only less likely
        to accept a sampled one.

        Args:
            prompt_ids: (m,) prompt tokens, m >= 1; all but the last are prefilled, the last is the first root.
            max_new_tokens: stop after this many tokens (the last step's tokens are truncated to fit).
            temperature: 0 for greedy decoding, > 0 for sampling (with ``top_k``/``top_p``, applied after it).
            top_p: nucleus mass kept when sampling (1.0 keeps all).
            top_k: tokens kept when sampling (0 keeps all).
            seed: seeds the sampling generator; None draws a fresh seed.
            eos_token_id: stop after emitting this token (or any of these tokens).

        Returns:
            the tokens and per-step statistics.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        eos = _eos_set(eos_token_id)
        generator = None
        if temperature > 0.0:
            generator = torch.Generator(device=self.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        source = self.draft_source
        session = source.start(prompt, self.max_nodes)
        tokens: list[int] = []
        steps: list[StepStats] = []
        since_last: list[int] = []
        pending: list[int] = []  # tokens of steps that asked for no draft, not sent to the source yet
        with torch.inference_mode():
            cache = new_cache(self.config)
            if len(prompt) > 1:
                self._forward(prompt[:-1], cache, logits_to_keep=1)
                trim_to_windows(cache)
            prefix_len = len(prompt) - 1
            root = prompt[-1]
            step_seconds = 0.0
            while len(tokens) < max_new_tokens:
                t0 = time.perf_counter()
                curve = self.budget.curve
                if self.adaptive and not self.budget.wants_draft():  # drafting is off: the tokens go with the next
                    self.budget.skip()                                 # request for a draft, or at the end
                    tree = EMPTY_TREE
                    pending += since_last
                else:
                    tree = source.draft(session, pending + since_last, self.max_nodes, step_seconds=step_seconds,
                                        plain_step_seconds=curve.plain_seconds(),
                                        verify_cost=curve.points() if self.adaptive else (),
                                        estimate_exponent=self.budget.calibration.gamma if self.adaptive else 0.0)
                    pending = []
                    if len(tree) > self.max_nodes:
                        tree = tree.prefix(self.max_nodes)
                    if self.adaptive:  # a skipped step was counted by skip(): choose only what was asked for
                        tree = tree.prefix(self.budget.choose(tree.probs, self.max_nodes, tree.parents))
                t1 = time.perf_counter()
                n = len(tree)
                mask = None
                positions = None
                if n:
                    mask = model_tree_mask(self.config, tree.parents, prefix_len, self.dtype, self.device)
                    positions = tree_positions(tree.parents, prefix_len, self.device)
                logits = self._forward([root, *tree.token_ids], cache, mask, positions)  # (n+1, V)
                verdict = self._verify(logits, tree, temperature, top_k, top_p, generator)
                keep_block_entries(cache, n + 1, [0] + [i + 1 for i in verdict.accepted])
                new = [tree.token_ids[i] for i in verdict.accepted] + [verdict.bonus]
                prefix_len += 1 + len(verdict.accepted)
                root = verdict.bonus
                t2 = time.perf_counter()
                step_seconds = t2 - t1
                accepted = set(verdict.accepted)
                self.budget.observe(n, step_seconds, tree.probs[:n], [i in accepted for i in range(n)])
                steps.append(StepStats(n, len(verdict.accepted), t2 - t0, t1 - t0))
                new = new[: max_new_tokens - len(tokens)]
                for j, tok in enumerate(new):
                    if tok in eos:
                        new = new[: j + 1]
                        break
                tokens.extend(new)
                since_last = new
                if new[-1] in eos:
                    break
        source.end(session, pending + since_last)
        return GenerationResult(tokens, steps)


def greedy_reference(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, one token per forward pass through the model's ordinary causal path.

    Args:
        model: a transformers causal LM (already on its device).
        prompt_ids: (m,) prompt tokens, m >= 1.
        max_new_tokens: tokens to generate.

    Returns:
        the generated tokens.
    """
    device = next(model.parameters()).device
    out: list[int] = []
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # (1, m) int64
        cache = None
        for _ in range(max_new_tokens):
            res = model(input_ids=ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
            cache = returned_cache(res)
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]], dtype=torch.long, device=device)  # (1, 1) int64
    return out
