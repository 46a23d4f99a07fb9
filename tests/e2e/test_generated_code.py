"""The committed gRPC code matches proto/drafter/v1/drafter.proto."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_generated_modules_import_from_their_package():
    from drafter_service.api.drafter.v1 import drafter_pb2, drafter_pb2_grpc

    assert drafter_pb2.DESCRIPTOR.package == "drafter.v1"
    assert hasattr(drafter_pb2_grpc, "DrafterStub")
