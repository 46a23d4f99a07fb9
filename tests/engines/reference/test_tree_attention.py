"""Tree masks, positions and the static cache's upkeep, checked against running every root-to-leaf path as a plain
sequence."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from engines.reference.step_runner import StepRunner
from engines.reference.tree_attention import (
    PAD_PARENT,
    attention_windows,
    block_depths,
    block_mask,
    block_reach,
    causal_reach,
    check_parents,
    model_layer_types,
    model_masks,
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


# --- pure functions, expected answers written beside them -------------------------------------------------------

def reach_of(parents: list[int]) -> torch.Tensor:
    return block_reach(torch.tensor(parents, dtype=torch.long))


def test_reach_and_depths_of_a_small_tree():
    #        root
    #       /    \
    #     n0      n1
    #    /  \       \
    #  n2    n3      n4
    #  |
    #  n5
    parents = [-1, -1, 0, 0, 1, 2]
    expected = [  # row = query (root, n0..n5), column = key (root, n0..n5)
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    reach = reach_of(parents)
    assert reach.int().tolist() == expected
    assert block_depths(reach).tolist() == [0, 1, 1, 2, 2, 2, 3]


def test_a_padding_node_sees_only_itself_and_a_long_chain_is_closed():
    reach = reach_of([-1, PAD_PARENT, 0, PAD_PARENT])
    assert reach.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                    [0, 0, 0, 0, 1]]
    chain64 = reach_of(list(range(-1, 63)))  # 64 deep: needs every squaring
    assert torch.equal(chain64, causal_reach(65))
    assert block_depths(chain64).tolist() == list(range(65))
    assert reach_of([]).tolist() == [[True]]


def test_bad_parents_are_rejected():
    check_parents([-1, 0, 0, 2])
    for bad in ([-1, 1], [0], [-1, -2]):
        with pytest.raises(ValueError):
            check_parents(bad)


def test_mask_layout_values_and_dtype():
    parents = [-1, 0, -1]
    reach = reach_of(parents)
    mask = block_mask(reach, block_depths(reach), torch.tensor(2), 7, torch.bfloat16)
    assert mask.shape == (1, 1, 4, 7) and mask.dtype == torch.bfloat16
    low = torch.finfo(torch.bfloat16).min
    allowed = [  # slots: p0 p1 | root n0 n1 n2 | past the block
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],
    ]
    expected = torch.tensor([[0.0 if a else low for a in row] for row in allowed], dtype=torch.bfloat16)
    assert torch.equal(mask[0, 0], expected)


def test_sliding_mask_keeps_only_keys_within_the_window():
    # slots 0-4 hold positions 0-4; the chain root -> n0 -> n1 sits at positions 5, 6, 7; window 3
    reach = reach_of([-1, 0])
    mask = block_mask(reach, block_depths(reach), torch.tensor(5), 8, torch.float32, window=3)
    assert (mask[0, 0] == 0).int().tolist() == [  # keys at positions 0 1 2 3 4 | 5 6 7
        [0, 0, 0, 1, 1, 1, 0, 0],  # query 5 sees 3..5
        [0, 0, 0, 0, 1, 1, 1, 0],  # query 6 sees 4..6
        [0, 0, 0, 0, 0, 1, 1, 1],  # query 7 sees 5..7
    ]
    # siblings share a position: both at 6, each seeing 4, 5 and itself
    reach = reach_of([-1, -1])
    mask = block_mask(reach, block_depths(reach), torch.tensor(5), 8, torch.float32, window=3)
    assert (mask[0, 0, 1:] == 0).int().tolist() == [[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 0, 1]]


def test_layer_types_pick_one_mask_or_one_per_kind():
    llama = tiny_llama("eager")
    assert model_layer_types(llama.config) == ["full_attention"] * 2
    reach = reach_of([-1])
    depths, prefix = block_depths(reach), torch.tensor(3)
    windows = attention_windows(llama.config)
    assert windows == {"full_attention": None}
    assert isinstance(model_masks(windows, reach, depths, prefix, 8, torch.float32), torch.Tensor)
    gemma = tiny_gemma("eager", 4)
    windows = attention_windows(gemma.config)
    assert windows == {"full_attention": None, "sliding_attention": 4}
    masks = model_masks(windows, reach, depths, prefix, 8, torch.float32)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert masks["full_attention"].shape == masks["sliding_attention"].shape == (1, 1, 2, 8)


# --- against real models ------------------------------------------------------------------------------------------

def runner_after(model, prefix: list[int], padded: bool) -> StepRunner:
    runner = StepRunner(model, 256, 32, graphs=False, padded=padded)
    runner.prefill(prefix)
    runner.cache.check_invariants()
    return runner


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_node_matches_its_path_run_as_a_plain_sequence(kind, attn, padded):
    model = MODELS[kind](attn)
    rng = random.Random(1)
    with torch.inference_mode():
        for prefix_len, n in [(0, 6), (1, 1), (6, 12), (9, 24), (3, 0)]:
            tokens, parents = random_tree(rng, n)
            seq = [rng.randrange(VOCAB) for _ in range(prefix_len + 1)]
            runner = runner_after(model, seq[:-1], padded)
            out = runner.step(seq[-1], tokens, parents)
            assert out.logits.shape[0] == runner.bucket(n) + 1 == (n if not padded else runner.bucket(n)) + 1
            reach = reach_of(parents)
            assert n < 6 or int(block_depths(reach).max()) >= 3
            for row in range(n + 1):
                ref = causal_last_logits(model, seq + path_tokens(tokens, parents, row - 1))
                torch.testing.assert_close(out.logits[row], ref, atol=TOL, rtol=0)
                assert int(out.target[row]) == int(ref.argmax())


@pytest.mark.parametrize("kind", ["llama", "gemma-window4"])
def test_a_plain_causal_block_mask_would_be_caught(kind):
    """The comparison above can fail: ignoring the tree (causal attention over the block) changes branch logits."""
    model = MODELS[kind]("eager")
    tokens, parents = [5, 6, 7, 8], [-1, -1, 1, 0]
    seq = [1, 2, 3, 4, 9, 10, 11]
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([seq + tokens])).logits[0, len(seq) - 1:]  # causal over the block
        ref = causal_last_logits(model, seq + path_tokens(tokens, parents, 1))
        assert (out[2] - ref).abs().max() > 1e-3


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_after_keeping_a_path_the_next_step_matches_a_fresh_run(kind, attn, padded):
    model = MODELS[kind](attn)
    rng = random.Random(2)
    with torch.inference_mode():
        seq = [rng.randrange(VOCAB) for _ in range(7)]
        runner = runner_after(model, seq[:-1], padded)
        keep: list[int] = []
        for step in range(5):
            tokens, parents = random_tree(rng, 10)
            runner.step(seq[-1], tokens, parents, keep)
            leaf = [9, 5, 0, 3, 1][step]  # a deep path, a middle one, a single node, ...
            path = []
            node = leaf
            while node >= 0:
                path.append(node)
                node = parents[node]
            keep = path[::-1] if step < 3 else []  # ... and nothing accepted
            seq = seq + [tokens[i] for i in keep]
            runner.cache.length = len(seq)
            runner.cache.check_invariants()
            seq.append(rng.randrange(VOCAB))  # the bonus token: the next root
        # the next step, a small tree over the kept cache
        tokens, parents = [11, 12, 13], [-1, 0, -1]
        out = runner.step(seq[-1], tokens, parents, keep)
        for row in range(4):
            ref = causal_last_logits(model, seq + path_tokens(tokens, parents, row - 1))
            torch.testing.assert_close(out.logits[row], ref, atol=TOL, rtol=0)


def test_the_cache_refuses_what_does_not_fit():
    model = tiny_llama("eager")
    with torch.inference_mode():
        runner = StepRunner(model, 60, 32, graphs=False)
        assert runner.cache.capacity == 63  # capacity + the scratch slot: a multiple of 64
        with pytest.raises(ValueError):
            runner.prefill(list(range(64)))
        runner.prefill(list(range(40)))
        with pytest.raises(ValueError):
            runner.step(1, list(range(30)), list(range(-1, 29)))
        with pytest.raises(ValueError):
            runner.bucket(33)
