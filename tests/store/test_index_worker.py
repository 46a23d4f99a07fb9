"""Suffix index builds in a child process give exactly the in-process result."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import store
from store.index_worker import SEGMENT_PREFIX, IndexWorker, segment_name, sweep_orphans, worker_command
from store.suffix_index import build_arrays
from store.token_store import TokenStore


@pytest.fixture
def worker():
    w = IndexWorker()
    yield w
    w.close()


def test_child_process_builds_the_same_arrays(worker):
    rng = np.random.default_rng(0)
    for n in (1, 7, 5000):
        snap = rng.integers(0, 9, n).astype(np.int32)
        snap[::13] = -1
        got, want = worker.build_arrays(snap), build_arrays(snap)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2:] == want[2:]


def test_store_with_a_child_builder_answers_like_one_without(worker):
    rng = np.random.default_rng(1)
    stores = [TokenStore(capacity=5000, tail_tokens=16), TokenStore(capacity=5000, tail_tokens=16)]
    stores[1].builder = worker.build_arrays
    for _ in range(60):
        doc = rng.integers(0, 6, 40)
        for s in stores:
            s.append(doc)
            s.rebuild()
        ctx = rng.integers(0, 6, 8)
        a, b = (s.lookup(ctx, 8, 8, 6) for s in stores)
        assert a.match_len == b.match_len and np.array_equal(a.counts, b.counts) and np.array_equal(a.rows, b.rows)


def test_a_dead_child_is_replaced_or_the_build_happens_here(worker):
    snap = np.arange(100, dtype=np.int32) % 7
    worker.build_arrays(snap)
    worker._proc.kill()
    worker._proc.wait()
    got = worker.build_arrays(snap)  # the dead child fails this call; the result is built in-process
    assert np.array_equal(got[0], build_arrays(snap)[0])
    assert np.array_equal(worker.build_arrays(snap)[0], build_arrays(snap)[0])  # a new child serves again


def test_the_child_runs_this_installation_wherever_the_process_was_started(tmp_path):
    """A process started in a folder that holds another ``store`` package (another checkout) still gets its own
    worker: ``python -m store.index_worker`` would have imported the folder's."""
    fake = tmp_path / "other-checkout"
    (fake / "store").mkdir(parents=True)
    (fake / "store" / "__init__.py").write_text("")
    (fake / "store" / "index_worker.py").write_text(
        "import pathlib\npathlib.Path('FAKE_WORKER_RAN').write_text('x')\nraise SystemExit('the wrong worker')\n")
    script = tmp_path / "build.py"
    script.write_text(
        "import numpy as np\n"
        "from store.index_worker import IndexWorker\n"
        "w = IndexWorker()\n"
        "sa, keys, bits, per_key = w.build_arrays(np.array([3, 1, 2, -1, 1, 2, -1], dtype=np.int32))\n"
        "assert w._proc is not None and w._proc.poll() is None, 'the child died'\n"
        "print('sa', sa.tolist())\n"
        "w.close()\n")
    done = subprocess.run([sys.executable, str(script)], cwd=fake, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "failed" not in done.stderr and not (fake / "FAKE_WORKER_RAN").exists()
    assert done.stdout.split("\n")[0] == f"sa {build_arrays(np.array([3, 1, 2, -1, 1, 2, -1], np.int32))[0].tolist()}"
    assert worker_command()[-1] == str(Path(store.__file__).resolve().parent.parent)


def test_segments_of_services_that_no_longer_run_are_swept_and_others_kept(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for owner in (gone.pid, alive.pid, os.getpid()):
            (tmp_path / segment_name(owner, "out1-0")).write_bytes(b"x" * 100)
        (tmp_path / "psm_other").write_bytes(b"y")
        assert sweep_orphans(tmp_path) == 100
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [segment_name(alive.pid, "out1-0"), segment_name(os.getpid(), "out1-0"), "psm_other"])
    finally:
        alive.kill()
        alive.wait()


BUILDER = """
import sys
import numpy as np
from store.index_worker import IndexWorker
worker = IndexWorker()
worker._ensure()
print(worker._proc.pid, flush=True)
worker.build_arrays(np.random.default_rng(0).integers(0, 50, 6_000_000).astype(np.int32))
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="shared memory is not in /dev/shm here")
def test_a_service_killed_during_a_build_leaves_no_shared_memory_behind():
    before = set(Path("/dev/shm").iterdir())
    proc = subprocess.Popen([sys.executable, "-c", BUILDER], stdout=subprocess.PIPE, text=True,
                            cwd=Path(store.__file__).resolve().parent.parent)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    time.sleep(0.5)  # the snapshot is in shared memory and the child builds
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:  # the child ends its build on its own
        time.sleep(0.1)
    IndexWorker().close()  # a new service's builder sweeps what the killed one left
    assert not list(Path("/dev/shm").glob(f"{SEGMENT_PREFIX}{proc.pid}-*"))
    assert not [p for p in set(Path("/dev/shm").iterdir()) - before if not p.name.startswith("sem.")]
