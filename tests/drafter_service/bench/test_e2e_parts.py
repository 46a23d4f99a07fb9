"""Parts of `drafter bench e2e`: the step-cost probe, the dtype choice, random-token prompts, fixed budgets, the
device flag, hf-static, the report's breakdown and the machine line."""

import argparse

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.bench.e2e import HfStatic, _hf_generate, fixed_budgets, resolve_device, settling_prompts
from drafter_service.bench.e2e_prompts import RANDOM_PROMPT_TOKENS, RANDOM_TOKEN_IDS, load_prompts
from drafter_service.bench.e2e_report import (
    Run,
    WorkloadResult,
    fastest_hf,
    format_headline,
    format_result,
    method_order,
    result_json,
)
from drafter_service.bench.step_costs import fastest_dtype, format_curve, measure_step_curve


def tiny(dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(dtype).eval()


def test_step_curve_times_every_size_and_leaves_the_model_usable():
    model = tiny()
    curve = measure_step_curve(model, (0, 1, 4, 16), context=32, repeats=2)
    assert list(curve) == [0, 1, 4, 16] and all(t > 0 for t in curve.values())
    line = format_curve(curve)
    assert line.startswith("t(n): 0: ") and "16: " in line


def test_fastest_dtype_is_the_one_with_the_quickest_plain_step(monkeypatch):
    made = []

    def load(dtype):
        made.append(dtype)
        return tiny(dtype)

    best, times = fastest_dtype(load)
    assert made == [torch.bfloat16, torch.float32] and set(times) == set(made)
    assert times[best] == min(times.values())


def test_random_prompts_are_reproducible_and_skip_like_the_others():
    first = load_prompts("random", 3)
    again = load_prompts("random", 2, skip=1)
    assert [p.prompt_id for p in again] == [p.prompt_id for p in first[1:]]
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(again, first[1:], strict=True))
    for p in first:
        assert p.token_ids.dtype == np.int32 and p.token_ids.size == RANDOM_PROMPT_TOKENS
        assert RANDOM_TOKEN_IDS[0] <= p.token_ids.min() and p.token_ids.max() < RANDOM_TOKEN_IDS[1]
    assert not np.array_equal(first[0].token_ids, first[1].token_ids)


def test_fixed_budgets_parse_and_run_after_drafter():
    assert fixed_budgets(argparse.Namespace(fixed_budgets="8,0, 2,8")) == [0, 2, 8]
    assert fixed_budgets(argparse.Namespace(fixed_budgets="")) == []
    for bad in ("4,x", "-1"):
        with pytest.raises(SystemExit):
            fixed_budgets(argparse.Namespace(fixed_budgets=bad))
    order = sorted(["fixed-16", "hf", "fixed-2", "drafter", "greedy"], key=method_order)
    assert order == ["greedy", "drafter", "fixed-2", "fixed-16", "hf"]


def test_engines_settle_on_the_last_warm_requests():
    warm = load_prompts("random", 5)
    assert [p.prompt_id for p in settling_prompts(warm, 2)] == [p.prompt_id for p in warm[-2:]]
    assert settling_prompts(warm, 0) == []
    assert len(settling_prompts(warm, 9)) == 5
    with pytest.raises(SystemExit, match="--engine-warm"):
        settling_prompts(warm, -1)


def test_the_device_flag_resolves_auto_and_refuses_cuda_where_torch_has_none(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    for bad in ("gpu", "cuda:x", "cuda0", ""):
        with pytest.raises(SystemExit, match="--device takes auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    for cuda in ("cuda", "cuda:1", " CUDA:0 "):
        with pytest.raises(SystemExit, match=r"--device cuda.*use --device cpu or auto"):
            resolve_device(cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(SystemExit, match="cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_the_cuda_refusal_comes_before_anything_loads(monkeypatch):
    from drafter_service.cli.main import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = []
    monkeypatch.setattr("drafter_service.datasets.target_model.load_smollm2", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit, match="--device cuda:0: "):
        args = build_parser().parse_args(["bench", "e2e", "--device", "cuda:0", "--methods", "greedy"])
        args.func(args)
    assert not loaded


def test_hf_static_on_the_cpu_is_greedy_generate_with_a_static_cache():
    model = tiny()
    prompts = [np.array([5, 17, 42, 8, 9], dtype=np.int32), np.array([3, 1, 4, 1, 5, 9, 26, 53], dtype=np.int32)]
    static = HfStatic(model)
    assert not static.compiled and static.mode.startswith("static cache alone")
    static.prepare(prompts, 12)
    assert static.max_cache_len == 8 + 12 and static.kwargs()["disable_compile"] is True
    for prompt in prompts:
        want, _ = _hf_generate(model, prompt, 12)
        got, seconds = static.generate(prompt, 12)
        assert got == want and len(got) > 0 and seconds > 0


def test_a_failing_compiled_call_falls_back_to_the_static_cache_alone(monkeypatch):
    model = tiny()
    static = HfStatic(model, compiled=True)
    calls = []

    def generate(*args, **kwargs):
        calls.append(kwargs)
        if "compile_config" in kwargs:
            raise RuntimeError("no compiler here")
        return torch.tensor([[1, 2, 3, 4]])

    monkeypatch.setattr(model, "generate", generate)
    tokens, _ = static.generate(np.array([1, 2], dtype=np.int32), 2)
    assert tokens == [3, 4] and not static.compiled
    assert "compiling failed (RuntimeError: no compiler here)" in static.mode
    assert [("compile_config" in c, c.get("disable_compile")) for c in calls] == [(True, None), (False, True)]


def _runs(method, secs, tokens, steps=0, **sums):
    return [Run(method, f"p{i}", list(t), s, steps, **sums) for i, (s, t) in enumerate(zip(secs, tokens, strict=True))]


def test_the_report_breaks_steps_down_and_names_transformers_fastest_greedy():
    same, other = [1, 2, 3, 4], [1, 2, 9, 9]
    res = WorkloadResult("set", hf_static="static cache alone: not compiled on cpu")
    res.runs += _runs("greedy", [1.0, 1.0], [same, same], steps=4, forward_seconds=0.8, check_seconds=0.1,
                      drafted_nodes=0, padded_nodes=0)
    res.runs += _runs("drafter", [0.5, 0.5], [same, other], steps=2, draft_seconds=0.02, forward_seconds=0.4,
                      check_seconds=0.04, drafted_nodes=6, padded_nodes=8)
    res.runs += _runs("fixed-4", [0.8, 0.8], [same, same], steps=2, forward_seconds=0.6, drafted_nodes=8,
                      padded_nodes=8)
    res.runs += _runs("hf", [2.0, 2.0], [same, same])
    res.runs += _runs("hf-static", [1.6, 1.6], [same, other])
    text = format_result(res)
    header = text.splitlines()[1].split()
    assert header[-6:] == ["vs", "greedy", "vs", "hf", "vs", "hf-static"] and "hf-pld" not in header
    drafter_row = next(line.split() for line in text.splitlines() if line.strip().startswith("drafter "))
    assert drafter_row[-3:] == ["2.00x", "4.00x", "3.20x"]  # vs greedy, vs hf, vs hf-static
    assert "transformers' fastest greedy: hf-static, 2.5 tok/s (hf 2.0 tok/s)" in text
    assert "hf-static: static cache alone: not compiled on cpu" in text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["per", "step"])
    rows = {line.split()[0]: line.split()[1:] for line in lines[start + 1:start + 4]}
    assert list(rows) == ["greedy", "drafter", "fixed-4"]  # engine methods only, in running order
    assert rows["greedy"] == ["8", "0.00", "200.00", "25.00", "0.0", "0.0"]  # 8 steps: 1.6 s forward, 0.2 s check
    assert rows["drafter"] == ["4", "10.00", "200.00", "20.00", "3.0", "4.0"]
    assert rows["fixed-4"] == ["4", "0.00", "300.00", "0.00", "4.0", "4.0"]
    for method, equal in (("drafter", 1), ("fixed-4", 2), ("hf", 2), ("hf-static", 1)):
        assert f"  {method} output equal to greedy: {equal}/2 requests" in text
    assert "time asking for drafts: 4.00% of generation" in text
    data = result_json(res, device="cpu")
    assert data["fastest_hf"] == "hf-static" and set(data["breakdown"]) == {"greedy", "drafter", "fixed-4"}
    assert data["breakdown"]["drafter"]["padded"] == 4.0 and data["runs"][0]["forward_seconds"] == 0.8
    assert fastest_hf(WorkloadResult("empty")) is None



def test_the_headline_adds_pre_speculation_and_the_best_fixed_budget_when_they_ran():
    same = [1, 2, 3, 4]
    res = WorkloadResult("set")
    for method, secs in (("greedy", 1.0), ("drafter", 0.5), ("drafter-pre", 0.4), ("fixed-4", 0.8),
                         ("fixed-8", 0.6), ("hf-pld", 1.0)):
        res.runs += _runs(method, [secs, secs], [same, same], steps=2)
    args = argparse.Namespace(dtype="float32", threads=2, max_new_tokens=4, requests=2, warm=1)
    lines = format_headline([res], args).splitlines()
    assert lines[2] == ("| workload | greedy tok/s | drafter tok/s (MAT) | drafter vs greedy | drafter-pre vs greedy "
                        "| best fixed vs greedy | drafter vs best fixed | drafter vs prompt lookup |")
    assert lines[4] == "| set | 4.0 | 8.0 (2.00) | 2.00× | 2.50× | fixed-8 1.67× | 1.20× | 2.00× |"
    plain = WorkloadResult("set", runs=[r for r in res.runs if r.method in ("greedy", "drafter")])
    assert format_headline([plain], args).splitlines()[4] == "| set | 4.0 | 8.0 (2.00) | 2.00× | - |"

def test_the_machine_line_without_cuda(monkeypatch):
    import importlib.metadata

    from drafter_service.bench import machine as machine_module

    host = machine_module.cpu_machine()
    version = importlib.metadata.version("torch")
    assert machine_module.machine() == host  # no device named: benches without a model
    assert machine_module.machine("cpu") == f"{host}; torch {version}"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine_module.machine("cuda") == f"{host}; torch {version}"  # no GPU to describe
    machine_module.use_device("cpu")
    try:
        assert machine_module.machine() == f"{host}; torch {version}"
    finally:
        machine_module.use_device(None)
    assert machine_module.machine() == host


def test_the_machine_line_names_the_gpu_its_driver_and_cuda(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from drafter_service.bench import machine as machine_module

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 550.54.15\necho 550.54.15\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake GPU {i}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    line = machine_module.machine("cuda:1")
    assert line.startswith("Fake GPU 1 (80 GiB, driver 550.54.15, CUDA 12.4); torch ")
    assert line.endswith(f"; host {machine_module.cpu_machine()}")
    smi.unlink()
    assert machine_module.gpu_machine("cuda:0") == "Fake GPU 0 (80 GiB, CUDA 12.4)"  # no driver found: omitted
