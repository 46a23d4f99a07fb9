"""The client installs alone: `pip install drafter` into a fresh environment brings grpcio, protobuf and numpy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What a client-only environment may hold besides the project: its three dependencies, theirs, and pip's own.
CLIENT_DISTRIBUTIONS = {"drafter", "grpcio", "protobuf", "numpy", "typing-extensions", "typing_extensions", "pip",
                        "setuptools", "wheel"}


@pytest.mark.timeout(900)
def test_the_client_installs_alone_and_the_service_says_how_to_install_it(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    install = subprocess.run([py, "-m", "pip", "install", "--quiet", str(ROOT)], capture_output=True, text=True,
                             timeout=800)
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    names = {d["name"].lower() for d in json.loads(listed.stdout)}
    assert {"drafter", "grpcio", "protobuf", "numpy"} <= names
    assert names <= CLIENT_DISTRIBUTIONS, f"more than the client's dependencies: {sorted(names - CLIENT_DISTRIBUTIONS)}"
    imported = subprocess.run(
        [py, "-c", "import sys, engine_client, engines.vllm; from engine_client import DrafterClient; "
         "print(sorted(m for m in ('torch', 'redis', 'transformers') if m in sys.modules))"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"
    serve = subprocess.run([str(venv / "bin" / "drafter"), "serve"], capture_output=True, text=True, cwd=tmp_path,
                           timeout=120)
    assert serve.returncode == 2
    assert "client only" in serve.stderr and "pip install 'drafter[service]'" in serve.stderr
