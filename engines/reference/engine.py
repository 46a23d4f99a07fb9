"""A reference engine on torch + transformers: draft, verify the tree in one forward pass, keep the accepted path."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from drafter_service.api.verify_budget import VerifyBudget
from engine_client.draft_source import EMPTY_TREE, DraftSource, DraftTree, NoDrafts
from engines.reference.kv_cache import returned_cache, with_cache
from engines.reference.step_runner import StepOutput, StepRunner
from engines.reference.tree_attention import check_parents
from engines.reference.verification import Verdict, greedy_path, sample_verify

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
        forward_seconds: the part spent from handing the step's inputs to the device until its argmaxes were read
            back: the cache upkeep of the previous step, the mask and positions, the forward pass.
        padded: the size the step ran at (``drafted`` padded to a captured size; ``drafted`` when eager).
    """

    drafted: int
    accepted: int
    seconds: float
    draft_seconds: float
    forward_seconds: float = 0.0
    padded: int = 0

    @property
    def verify_seconds(self) -> float:
        """Time of the forward pass, verification and cache upkeep."""
        return self.seconds - self.draft_seconds

    @property
    def check_seconds(self) -> float:
        """Time after the forward: finding the accepted path and the step's bookkeeping."""
        return self.seconds - self.draft_seconds - self.forward_seconds


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
    """Speculative decoding of one request at a time with a transformers causal LM (batch 1, a static KV cache).

    Drafting off (``NoDrafts``) and on take the same path: an empty tree is a plain one-token step. On a CUDA device
    every step is a captured CUDA graph (``StepRunner``), the plain step included; a tree is padded to the next
    captured size and the padding is filled with more of the tree's nodes when it has them.
    """

    def __init__(self, model: torch.nn.Module, draft_source: DraftSource | None = None, max_nodes: int = 32,
                 device: torch.device | str | None = None, adaptive: bool = False, min_nodes: int = 0,
                 budget: VerifyBudget | None = None, graphs: bool | None = None, padded: bool | None = None) -> None:
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
            graphs: capture the steps as CUDA graphs (None: on a CUDA device; False: eager everywhere).
            padded: run every step at a captured size over every cache slot, as the graphs do (None: with graphs);
                eager and padded is the graphs' computation, for checking it without a GPU.
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
        self.graphs, self.padded = graphs, padded
        self._runner: StepRunner | None = None

    def runner(self, tokens: int) -> StepRunner:
        """The step runner, with room for a sequence of ``tokens`` tokens and one step's tree (grown when needed:
        a new cache, and new graphs where they are captured)."""
        need = tokens + self.max_nodes + 1
        if self._runner is None or self._runner.cache.capacity < need:
            capacity = max(1024, 1 << (need - 1).bit_length())
            self._runner = None  # the old cache and graphs go before the new ones are allocated
            with torch.inference_mode():
                self._runner = StepRunner(self.model, capacity, self.max_nodes, self.graphs, self.padded)
            logger.info("reference engine: %d cache slots, steps %s", self._runner.cache.capacity,
                        f"captured at sizes {self._runner.buckets}" if self._runner.graphs else
                        f"eager at sizes {self._runner.buckets or 'as drafted'}")
        return self._runner

    def _verify(self, out: StepOutput, tree: DraftTree, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> Verdict:
        n = len(tree)
        if temperature <= 0.0:
            return greedy_path(out.target[:n + 1].tolist(), tree.token_ids, tree.parents)  # the step's one read
        return sample_verify(out.logits[:n + 1], tree.token_ids, tree.parents, temperature=temperature, top_k=top_k,
                             top_p=top_p, generator=generator, draft_probs=getattr(tree, "draft_probs", None) or None)

    def _choose(self, tree: DraftTree, runner: StepRunner) -> DraftTree:
        """The part of ``tree`` this step verifies: the budget's choice, padded to the size the step runs at."""
        if len(tree) > self.max_nodes:
            tree = tree.prefix(self.max_nodes)
        n = self.budget.choose(tree.probs, self.max_nodes, tree.parents) if self.adaptive else len(tree)
        # a captured step costs the same for any tree up to its size: fill it with the tree's next nodes
        return tree.prefix(min(len(tree), runner.bucket(min(n, len(tree)))))

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
        runner = self.runner(len(prompt) + max_new_tokens)
        source = self.draft_source
        session = source.start(prompt, self.max_nodes)
        tokens: list[int] = []
        steps: list[StepStats] = []
        since_last: list[int] = []
        pending: list[int] = []  # tokens of steps that asked for no draft, not sent to the source yet
        keep: list[int] = []  # the last step's accepted nodes, moved into place by the next step
        with torch.inference_mode():
            runner.prefill(prompt[:-1])
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
                    # the whole tree, cut here: the budget's per-bin calibration knows what the engine accepts better
                    # than a cut by the service (whose power-law fit left 1-2 nodes where 4-16 paid), and a deep
                    # tree lets the source serve the next steps from it
                    tree = source.draft(session, pending + since_last, self.max_nodes, step_seconds=step_seconds,
                                        plain_step_seconds=curve.plain_seconds())
                    pending = []
                    tree = self._choose(tree, runner)
                    check_parents(tree.parents)
                t1 = time.perf_counter()
                n = len(tree)
                out = runner.step(root, tree.token_ids, tree.parents, keep)
                verdict = self._verify(out, tree, temperature, top_k, top_p, generator)
                t2 = time.perf_counter()
                keep = verdict.accepted
                runner.cache.length += 1 + len(keep)
                new = [tree.token_ids[i] for i in keep] + [verdict.bonus]
                root = verdict.bonus
                accepted = set(keep)
                t3 = time.perf_counter()
                step_seconds = t3 - t1
                self.budget.observe(n, step_seconds, tree.probs[:n], [i in accepted for i in range(n)])
                steps.append(StepStats(n, len(keep), t3 - t0, t1 - t0, t2 - t1, runner.bucket(n)))
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
