"""Sampling with speculation yields exactly the target's sequence distribution (chi-square), and broken rules do not."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.api.tree import DraftTree
from engines.reference import verification
from engines.reference.engine import ReferenceEngine
from engines.reference.verification import process_logits, sample_verify

V = 5  # toy vocabulary
LENGTH = 3  # generated tokens per sample: V**3 = 125 possible sequences
PROMPT = (0, 1)
SAMPLES = 4000
PASS_P = 1e-3  # a correct rule must not be rejected at this level (seeds are fixed: the outcome is deterministic)
FAIL_P = 1e-6  # a broken rule must be rejected at this level


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine_client/conftest.py


# --- the statistic ------------------------------------------------------------------------------------------------

def chi2_sf(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (the regularised upper incomplete gamma function)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(counts: Counter, probs: dict[tuple[int, ...], float]) -> float:
    """p-value of Pearson's test of ``counts`` against ``probs``; cells expecting < 5 are pooled."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), "a sequence the target cannot produce was sampled"
    stat, cells, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for seq, p in probs.items():
        exp = n * p
        if exp < 5:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += exp
            continue
        stat += (counts.get(seq, 0) - exp) ** 2 / exp
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return chi2_sf(stat, cells - 1)


def homogeneity(a: Counter, b: Counter) -> float:
    """p-value of Pearson's two-sample test that ``a`` and ``b`` come from one distribution (rare cells pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    table, rare = [], [0, 0]
    for k in keys:
        if a.get(k, 0) + b.get(k, 0) < 10:
            rare[0] += a.get(k, 0)
            rare[1] += b.get(k, 0)
        else:
            table.append((a.get(k, 0), b.get(k, 0)))
    if sum(rare):
        table.append(tuple(rare))
    stat = 0.0
    for oa, ob in table:
        tot = oa + ob
        for obs, n in ((oa, na), (ob, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return chi2_sf(stat, len(table) - 1)


def test_the_statistic_accepts_the_truth_and_rejects_a_small_bias():
    probs = {(i,): p for i, p in enumerate([0.1, 0.2, 0.3, 0.4])}
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor([0.1, 0.2, 0.3, 0.4]), SAMPLES, replacement=True, generator=gen)
    assert goodness_of_fit(Counter((int(d),) for d in draws), probs) > PASS_P
    biased = torch.multinomial(torch.tensor([0.1, 0.25, 0.25, 0.4]), SAMPLES, replacement=True, generator=gen)
    assert goodness_of_fit(Counter((int(d),) for d in biased), probs) < FAIL_P
    assert homogeneity(Counter((int(d),) for d in draws), Counter((int(d),) for d in biased)) < FAIL_P


# --- a toy target and draft model: logits are a fixed random function of the last two tokens ----------------------

_TARGET = torch.randn(V, V, V, generator=torch.Generator().manual_seed(11)) * 1.5  # (V, V, V) float32
_DRAFT = torch.randn(V, V, V, generator=torch.Generator().manual_seed(12)) * 1.5  # (V, V, V) float32


def target_logits(ctx: Sequence[int]) -> torch.Tensor:
    return _TARGET[ctx[-2], ctx[-1]]  # (V,)


def draft_q(ctx: Sequence[int]) -> torch.Tensor:
    return _DRAFT[ctx[-2], ctx[-1]].softmax(-1)  # (V,)


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    qs: list[torch.Tensor | None] = field(default_factory=list)

    def add(self, tok: int, parent: int, q: torch.Tensor | None = None) -> int:
        self.tokens.append(tok)
        self.parents.append(parent)
        self.qs.append(q)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]


Drafter = Callable[[list[int], random.Random], Tree]


def no_tree(ctx: list[int], rng: random.Random) -> Tree:
    return Tree()


def fixed_tree(ctx: list[int], rng: random.Random) -> Tree:
    """The same one-hot tree whatever the context: three root children, branches two deep below two of them."""
    t = Tree()
    a, b, _ = t.add(0, -1), t.add(1, -1), t.add(2, -1)
    a3, _ = t.add(3, a), t.add(4, a)
    t.add(1, a3), t.add(2, a3)
    b0 = t.add(0, b)
    t.add(4, b0)
    return t


def likely_tree(ctx: list[int], rng: random.Random) -> Tree:
    """One-hot, the target's two likeliest tokens at every node, three deep (accepts a lot)."""
    t = Tree()
    frontier = [-1]
    for _ in range(3):
        nxt = []
        for node in frontier:
            logits = target_logits(ctx + t.path(node))
            for tok in torch.topk(logits, 2).indices.tolist():
                nxt.append(t.add(tok, node))
        frontier = nxt
    return t


def _sample(q: torch.Tensor, rng: random.Random) -> int:
    return rng.choices(range(V), weights=q.tolist())[0]


def sampled_tree(ctx: list[int], rng: random.Random) -> Tree:
    """Three root children drawn i.i.d. from the draft model (repeats kept), two children each drawn the same way."""
    t = Tree()
    q = draft_q(ctx)
    for _ in range(3):
        child = t.add(_sample(q, rng), -1, q)
        q2 = draft_q(ctx + [t.tokens[child]])
        for _ in range(2):
            t.add(_sample(q2, rng), child, q2)
    return t


def mixed_tree(ctx: list[int], rng: random.Random) -> Tree:
    """A deterministic first guess (the draft model's argmax, one-hot) then two sampled siblings, each with a child."""
    t = Tree()
    q = draft_q(ctx)
    first = t.add(int(q.argmax()), -1)
    t.add(int(draft_q(ctx + [t.tokens[first]]).argmax()), first)
    for _ in range(2):
        child = t.add(_sample(q, rng), -1, q)
        q2 = draft_q(ctx + [t.tokens[child]])
        t.add(_sample(q2, rng), child, q2)
    return t


def generate(drafter: Drafter, seed: int, temperature: float, top_k: int, top_p: float) -> tuple[int, ...]:
    """One sample of LENGTH tokens by speculative steps over the toy target."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ctx, out = list(PROMPT), []
    while len(out) < LENGTH:
        tree = drafter(ctx, rng)
        logits = torch.stack([target_logits(ctx)] + [target_logits(ctx + tree.path(i))
                                                    for i in range(len(tree.tokens))])  # (n+1, V)
        qs = tree.qs if any(q is not None for q in tree.qs) else None
        verdict = sample_verify(logits, tree.tokens, tree.parents, temperature=temperature, top_k=top_k,
                                top_p=top_p, generator=gen, draft_probs=qs)
        new = [tree.tokens[i] for i in verdict.accepted] + [verdict.bonus]
        ctx += new
        out += new
    return tuple(out[:LENGTH])


def exact(temperature: float, top_k: int, top_p: float) -> dict[tuple[int, ...], float]:
    """Probability of every LENGTH-token continuation under the processed toy target."""
    probs = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        ctx, p = list(PROMPT), 1.0
        for tok in seq:
            p *= float(process_logits(target_logits(ctx), temperature, top_k, top_p)[tok])
            ctx.append(tok)
        if p > 0:
            probs[seq] = p
    return probs


def counts(drafter: Drafter, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           n: int = SAMPLES) -> Counter:
    return Counter(generate(drafter, seed, temperature, top_k, top_p) for seed in range(n))


SETTINGS = [(1.0, 0, 1.0), (0.8, 4, 0.9)]
DRAFTERS = {"fixed": fixed_tree, "likely": likely_tree, "sampled": sampled_tree, "mixed": mixed_tree}


@pytest.mark.parametrize("setting", SETTINGS, ids=["t1", "t0.8-k4-p0.9"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_speculative_sampling_has_the_target_distribution(name, setting):
    probs = exact(*setting)
    spec = counts(DRAFTERS[name], *setting)
    assert goodness_of_fit(spec, probs) > PASS_P
    if name == "fixed":  # the plain sampler passes too, and the two samples agree with each other
        plain = counts(no_tree, *setting)
        assert goodness_of_fit(plain, probs) > PASS_P
        assert homogeneity(spec, plain) > PASS_P


def _always_accept_one_hot(p_x, q_x):
    return 1.0 if q_x is None else min(1.0, p_x / q_x)


def _keep_rejected_one_hot(p, x, q):
    return p if q is None else _RESIDUAL(p, x, q)


def _ignore_q_in_residual(p, x, q):
    return _RESIDUAL(p, x, None)


def _accept_sampled_with_p(p_x, q_x):
    return p_x


def _residual_not_renormalised(p, x, q):
    if q is None:
        return _RESIDUAL(p, x, q)
    out = torch.clamp(p - q, min=0.0)
    return out if float(out.sum()) > 0 else p


_RESIDUAL = verification.residual

BROKEN = {
    "one-hot children always accepted": ("acceptance_probability", _always_accept_one_hot, fixed_tree),
    "rejected one-hot token not zeroed": ("residual", _keep_rejected_one_hot, fixed_tree),
    "residual ignores q (zeroes the token instead)": ("residual", _ignore_q_in_residual, sampled_tree),
    "sampled child accepted with p(x), not p(x)/q(x)": ("acceptance_probability", _accept_sampled_with_p,
                                                        sampled_tree),
    "residual max(p - q, 0) not renormalised": ("residual", _residual_not_renormalised, sampled_tree),
}


@pytest.mark.parametrize("bug", list(BROKEN))
def test_a_broken_rule_is_detected_by_the_same_statistic(bug, monkeypatch):
    attr, broken, drafter = BROKEN[bug]
    monkeypatch.setattr(verification, attr, broken)
    probs = exact(1.0, 0, 1.0)
    assert goodness_of_fit(counts(drafter), probs) < FAIL_P


# --- through the engine, on a tiny random Llama with a five-token vocabulary ---------------------------------------

@dataclass(frozen=True)
class SampledDraftTree(DraftTree):
    """A DraftTree whose nodes carry the distribution they were sampled from (None: one-hot)."""

    draft_probs: tuple = field(default=(), compare=False)


class ScriptedSource:
    """A draft source over a hand-made draft model: a one-hot guess plus sampled siblings, two levels deep."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ctx: list[int] = []

    def start(self, prompt, max_nodes=0):
        self.ctx = list(prompt)
        return "s"

    def draft(self, session, accepted, max_nodes=0, step_seconds=0.0, plain_step_seconds=0.0, verify_cost=(),
              estimate_exponent=0.0):
        self.ctx += list(accepted)
        t = mixed_tree(self.ctx, self.rng)
        probs = tuple(1.0 for _ in t.tokens)
        return SampledDraftTree(tuple(t.tokens), tuple(t.parents), probs, float(len(probs)),
                                draft_probs=tuple(t.qs))

    def end(self, session, accepted):
        self.ctx = []


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      initializer_range=0.5, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


def model_exact(model, temperature: float) -> dict[tuple[int, ...], float]:
    seqs = torch.tensor([list(PROMPT) + list(s) for s in itertools.product(range(V), repeat=LENGTH)])
    with torch.inference_mode():
        logits = model(input_ids=seqs).logits  # (V**3, len(PROMPT)+LENGTH, V)
    probs = process_logits(logits, temperature)
    out = {}
    for row, seq in enumerate(seqs.tolist()):
        p = 1.0
        for j in range(LENGTH):
            p *= float(probs[row, len(PROMPT) - 1 + j, seq[len(PROMPT) + j]])
        out[tuple(seq[len(PROMPT):])] = p
    return out


def test_engine_sampling_with_sampled_and_one_hot_drafts_has_the_target_distribution():
    model = tiny_llama()
    probs = model_exact(model, 0.9)
    samples = Counter()
    accepted = 0
    for seed in range(2000):
        engine = ReferenceEngine(model, ScriptedSource(seed), max_nodes=16, device="cpu")
        res = engine.generate(list(PROMPT), LENGTH, temperature=0.9, seed=seed)
        samples[tuple(res.tokens)] += 1
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > 1000  # the drafts are used, not just verified away
    assert goodness_of_fit(samples, probs) > PASS_P
