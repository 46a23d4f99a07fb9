"""`drafter bench steps`: the step timings and phase breakdown, on a tiny model and from hand-built figures."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.bench.step_profile import PHASES, StepProfile, _sizes, format_profiles, profile_steps


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def test_every_size_gets_a_step_time_and_every_phase_a_host_time():
    profiles = profile_steps(tiny_llama(), [0, 4, 16], context=64, repeats=2)
    assert [p.nodes for p in profiles] == [0, 4, 16]
    for p in profiles:
        assert p.step_seconds > 0 and p.eager_seconds == p.step_seconds  # no graphs on a CPU
        assert set(p.host) == set(PHASES) and all(t >= 0 for t in p.host.values())
        assert p.host["forward"] > 0
        assert p.device == {} and p.reads == 0  # device figures only on CUDA


def test_the_table_shows_ratios_to_the_plain_step_and_to_the_forward():
    host = dict.fromkeys(PHASES, 0.001) | {"forward": 0.010}
    rows = [StepProfile(0, 0.010, 0.010, host), StepProfile(32, 0.020, 0.020, host | {"forward": 0.016})]
    table = format_profiles(rows, "title", graphs=False)
    lines = table.splitlines()
    assert lines[0] == "title"
    assert lines[5].startswith("| 32 | 20.00 | 2.00 | 1.25 |")
    assert "eager step ms" not in table and "device" not in table
    device = {"forward": 0.005}
    cuda = format_profiles([StepProfile(0, 0.006, 0.020, host, device, 1.0)], "t", graphs=True)
    assert "| 0 | 6.00 | 1.00 | 1.20 | 20.00 |" in cuda and "reads / step" in cuda


def test_bad_sizes_are_refused():
    assert _sizes("32,0,8,8") == [0, 8, 32]
    for bad in ("", "a", "-1,4"):
        with pytest.raises(SystemExit):
            _sizes(bad)
