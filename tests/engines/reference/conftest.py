"""Fixtures of the engine tests: torch on one thread (tiny models run far slower on two busy cores)."""

import pytest


@pytest.fixture
def one_thread():
    """Run the test with one torch thread, then restore the previous setting."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
