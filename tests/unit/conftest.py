import sys
from pathlib import Path

import pytest

# te_reference.py is a plain module beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def gloo():
    """A gloo process group of one rank (CPU) for FSDP2's ``fully_shard``,
    torn down after the test; skips where this torch build lacks either."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
