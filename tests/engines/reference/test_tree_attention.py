"""Tree masks, positions and KV gathering checked against running every root-to-leaf path as a plain sequence."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from engines.reference.kv_cache import (
    cache_length,
    check_invariants,
    keep_block_entries,
    new_cache,
    trim_to_windows,
    with_cache,
)
from engines.reference.tree_attention import (
    ancestor_matrix,
    model_layer_types,
    model_tree_mask,
    tree_depths,
    tree_mask,
    tree_positions,
)

VOCAB = 100
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine_client/conftest.py


def tiny_llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma(attn: str, window: int) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=window, max_position_embeddings=256, initializer_range=0.2,
                           tie_word_embeddings=False,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           attn_implementation=attn)
    return Gemma3ForCausalLM(cfg).eval()


MODELS = {
    "llama": lambda attn: tiny_llama(attn),
    # window far beyond every sequence here: sliding layers behave like full ones
    "gemma-wide": lambda attn: tiny_gemma(attn, 128),
    # window of 4: prefixes and paths are longer, so sliding layers drop keys and their cache is trimmed
    "gemma-window4": lambda attn: tiny_gemma(attn, 4),
}


def random_tree(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """Tokens and parents of a random tree of n nodes, skewed deep (a parent among the last few nodes)."""
    parents = [-1 if i == 0 else rng.choice([-1, *range(max(0, i - 3), i)]) for i in range(n)]
    return [rng.randrange(VOCAB) for _ in range(n)], parents


def path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def causal_last_logits(model, seq: list[int]) -> torch.Tensor:
    """Logits after ``seq`` from the model's ordinary causal path, no cache, no custom mask."""
    return model(input_ids=torch.tensor([seq])).logits[0, -1]  # (V,)


def tree_step(model, cache: DynamicCache, prefix_len: int, root: int, tokens: list[int],
              parents: list[int]) -> torch.Tensor:
    mask = model_tree_mask(model.config, parents, prefix_len, model.dtype)
    pos = tree_positions(parents, prefix_len)
    out = model(input_ids=torch.tensor([[root, *tokens]]), attention_mask=mask, position_ids=pos,
                **with_cache(model, cache), use_cache=True)
    return out.logits[0]  # (n+1, V)


def prefilled(model, prefix: list[int]) -> DynamicCache:
    cache = new_cache(model.config)
    if not prefix:
        return cache
    model(input_ids=torch.tensor([prefix]), **with_cache(model, cache), use_cache=True)
    trim_to_windows(cache)
    return cache


# --- pure functions, expected answers written beside them -------------------------------------------------------

def test_depths_positions_and_ancestors_of_a_small_tree():
    #        root
    #       /    \
    #     n0      n1
    #    /  \       \
    #  n2    n3      n4
    #  |
    #  n5
    parents = [-1, -1, 0, 0, 1, 2]
    assert tree_depths(parents) == [1, 1, 2, 2, 2, 3]
    assert tree_positions(parents, 10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    expected = [  # row = query (root, n0..n5), column = key (root, n0..n5)
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert ancestor_matrix(parents).int().tolist() == expected


def test_bad_parents_are_rejected():
    with pytest.raises(ValueError):
        tree_depths([-1, 1])
    with pytest.raises(ValueError):
        ancestor_matrix([0])


def test_mask_layout_values_and_dtype():
    parents = [-1, 0, -1]
    mask = tree_mask(parents, 2, torch.bfloat16)
    assert mask.shape == (1, 1, 4, 6) and mask.dtype == torch.bfloat16
    low = torch.finfo(torch.bfloat16).min
    allowed = [  # keys: p0 p1 | root n0 n1 n2
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]
    expected = torch.tensor([[0.0 if a else low for a in row] for row in allowed], dtype=torch.bfloat16)
    assert torch.equal(mask[0, 0], expected)


def test_sliding_mask_keeps_only_keys_within_the_window():
    # chain root -> n0 -> n1 at positions 5, 6, 7; the cache keeps positions 3, 4 (window 3 keeps 2 past tokens)
    mask = tree_mask([-1, 0], 5, past_len=2, sliding_window=3)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [  # keys at positions: 3 4 | 5 6 7
        [1, 1, 1, 0, 0],  # query 5 sees 3..5
        [0, 1, 1, 1, 0],  # query 6 sees 4..6
        [0, 0, 1, 1, 1],  # query 7 sees 5..7
    ]


def test_layer_types_pick_one_mask_or_one_per_kind():
    llama = tiny_llama("eager")
    assert model_layer_types(llama.config) == ["full_attention"] * 2
    assert isinstance(model_tree_mask(llama.config, [-1], 3, torch.float32), torch.Tensor)
    gemma = tiny_gemma("eager", 4)
    masks = model_tree_mask(gemma.config, [-1, 0], 9, torch.float32)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert masks["full_attention"].shape == (1, 1, 3, 12)
    assert masks["sliding_attention"].shape == (1, 1, 3, 3 + 3)


# --- against real models ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_node_matches_its_path_run_as_a_plain_sequence(kind, attn):
    model = MODELS[kind](attn)
    rng = random.Random(1)
    with torch.inference_mode():
        for prefix_len, n in [(0, 6), (1, 1), (6, 12), (9, 24)]:
            tokens, parents = random_tree(rng, n)
            seq = [rng.randrange(VOCAB) for _ in range(prefix_len + 1)]
            cache = prefilled(model, seq[:-1])
            logits = tree_step(model, cache, prefix_len, seq[-1], tokens, parents)
            assert n < 6 or max(tree_depths(parents)) >= 3
            for row in range(n + 1):
                ref = causal_last_logits(model, seq + path_tokens(tokens, parents, row - 1))
                torch.testing.assert_close(logits[row], ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "gemma-window4"])
def test_a_plain_causal_block_mask_would_be_caught(kind):
    """The comparison above can fail: ignoring the tree (causal attention over the block) changes branch logits."""
    model = MODELS[kind]("eager")
    tokens, parents = [5, 6, 7, 8], [-1, -1, 1, 0]
    seq = [1, 2, 3, 4, 9, 10, 11]
    with torch.inference_mode():
        cache = prefilled(model, seq[:-1])
        out = model(input_ids=torch.tensor([[seq[-1], *tokens]]), **with_cache(model, cache), use_cache=True).logits[0]
        ref = causal_last_logits(model, seq + path_tokens(tokens, parents, 1))
        assert (out[2] - ref).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_after_gathering_the_next_step_matches_a_fresh_run(kind, attn):
    model = MODELS[kind](attn)
    rng = random.Random(2)
    with torch.inference_mode():
        seq = [rng.randrange(VOCAB) for _ in range(7)]
        cache = prefilled(model, seq[:-1])
        prefix_len = len(seq) - 1
        for step in range(4):
            tokens, parents = random_tree(rng, 10)
            tree_step(model, cache, prefix_len, seq[-1], tokens, parents)
            leaf = [9, 5, 0, 3][step]  # a deep path, a middle one, a single node, ...
            path = []
            node = leaf
            while node >= 0:
                path.append(node)
                node = parents[node]
            path = path[::-1]
            if step == 3:
                path = []  # ... and nothing accepted
            keep_block_entries(cache, len(tokens) + 1, [0] + [i + 1 for i in path])
            seq = seq + [tokens[i] for i in path]
            prefix_len = len(seq)
            assert cache_length(cache) == prefix_len
            check_invariants(cache, prefix_len)  # full layers hold all, sliding ones their window
            seq.append(rng.randrange(VOCAB))  # the bonus token: the next root
        # the next step, a small tree over the gathered cache
        tokens, parents = [11, 12, 13], [-1, 0, -1]
        logits = tree_step(model, cache, prefix_len, seq[-1], tokens, parents)
        for row in range(4):
            ref = causal_last_logits(model, seq + path_tokens(tokens, parents, row - 1))
            torch.testing.assert_close(logits[row], ref, atol=TOL, rtol=0)


def test_keep_rejects_unordered_indices_and_unrecorded_sliding_layers():
    model = tiny_gemma("eager", 4)
    with torch.inference_mode():
        cache = prefilled(model, [1, 2, 3])
        with pytest.raises(ValueError):
            keep_block_entries(cache, 3, [0, 2, 1])
        with pytest.raises(AssertionError):
            check_invariants(cache, 4)
        plain = DynamicCache(config=model.config)  # sliding layers that forget their past
        model(input_ids=torch.tensor([[1, 2, 3]]), **with_cache(model, plain), use_cache=True)
        with pytest.raises(ValueError):
            keep_block_entries(plain, 2, [0])
