"""Hypothesis strategies shared by the client's tests."""

from __future__ import annotations

from hypothesis import strategies as st

from drafter_service.api.tree import DraftTree


@st.composite
def trees(draw: st.DrawFn) -> DraftTree:
    """A draft tree of up to 12 nodes over tokens 0 to 6: siblings distinct, a child no likelier than its parent."""
    n = draw(st.integers(0, 12))
    parents: list[int] = []
    tokens: list[int] = []
    probs: list[float] = []
    for i in range(n):
        parent = draw(st.integers(-1, i - 1))
        taken = {t for t, p in zip(tokens, parents, strict=True) if p == parent}
        tokens.append(draw(st.integers(0, 6).filter(lambda t, taken=taken: t not in taken)))
        parents.append(parent)
        probs.append(draw(st.floats(0.01, 1.0)) * (probs[parent] if parent >= 0 else 1.0))
    return DraftTree(tuple(tokens), tuple(parents), tuple(probs), float(sum(probs)))
