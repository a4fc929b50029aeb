from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # The models here are tiny: intra-op threads only add overhead, and when the two cores
    # are shared with other jobs OpenMP threads wait on each other (tests ran ~50x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
