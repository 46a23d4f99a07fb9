"""What machine a benchmark ran on: every figure is reported with it.

torch is never imported here at module level (benchmarks without a model use this too): a benchmark that runs a
model names its device (``machine(device)``, or ``use_device`` for every later ``machine()``), and only then are torch's
version and, on CUDA, the GPU described.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import subprocess

from drafter_service.model.hardware import cpu_model_and_flags

logger = logging.getLogger(__name__)

__all__ = ["cpu_machine", "driver_version", "gpu_machine", "machine", "use_device"]

#: The device this process's benchmark runs its model on (``use_device``); None: none named.
_device: str | None = None


def use_device(device: str | None) -> None:
    """Name the device this process's benchmark measures on: every later ``machine()`` describes it (the tables a
    benchmark writes into the docs included). None forgets it."""
    global _device
    _device = device


def cpu_machine() -> str:
    """CPU model, core count and the vector extensions the figures depend on."""
    model, flags = cpu_model_and_flags()
    vector = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({os.cpu_count()} cores; {', '.join(vector) or 'no AVX2'})"


def machine(device: str | None = None) -> str:
    """The machine a benchmark's figures come from.

    Args:
        device: where the model ran: "cpu", "cuda" or "cuda:N" (None: the one given to ``use_device``; without one,
            the CPU alone and torch not named).

    Returns:
        Without a device, the CPU's description; on the CPU, it with torch's version; on CUDA, the GPU model, its
        memory, the driver (where it can be found) and CUDA runtime, torch's version, then the host's CPU.
    """
    device = device or _device
    host = cpu_machine()
    if device is None:
        return host
    torch = _torch_version()
    gpu = gpu_machine(device) if device.startswith("cuda") else None
    if gpu:
        return f"{gpu}; {torch}; host {host}" if torch else f"{gpu}; host {host}"
    return f"{host}; {torch}" if torch else host


def _torch_version() -> str:
    """``torch X`` from the installed package's metadata (torch not imported); empty without torch."""
    try:
        return f"torch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        return ""


def gpu_machine(device: str) -> str | None:
    """``NAME (N GiB, driver D, CUDA R)`` of a CUDA device; None where torch or CUDA is missing.

    Args:
        device: "cuda" (the current device) or "cuda:N".
    """
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        name = torch.cuda.get_device_name(index)
        memory = torch.cuda.get_device_properties(index).total_memory / 2**30
    except (RuntimeError, AssertionError, ValueError) as exc:  # a device that cannot be queried: no description
        logger.warning("cannot describe %s: %s", device, exc)
        return None
    parts = [f"{memory:.0f} GiB"]
    driver = driver_version()
    if driver:
        parts.append(f"driver {driver}")
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    return f"{name} ({', '.join(parts)})"


def driver_version() -> str | None:
    """The NVIDIA driver's version: from ``nvidia-smi`` where it is installed, else from torch where it tells; None
    where neither does."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        line = next((x.strip() for x in out.splitlines() if x.strip()), "")
        if line:
            return line  # one driver serves every GPU of the machine
    try:
        import torch
    except ImportError:
        return None
    found = getattr(torch.cuda, "driver_version", None)  # not in every torch release
    if found is None:
        return None
    try:
        value = found() if callable(found) else found
    except RuntimeError:
        return None
    return str(value) if value else None
