"""Training tests: helpers beside this file (tabular_data.py, plugin_models.py) are importable by name."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# MLflow (test_tracking.py) starts usage telemetry, which calls out to the network, when it is
# imported outside a running test (at collection); tests never touch the network.
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"


@pytest.fixture(scope="session", autouse=True)
def _torch_settled():
    """torch sets TORCHINDUCTOR_CACHE_DIR in os.environ on its first optimizer step (torch's doing,
    not a test's leak): take that step once before the per-test environment guard looks."""
    import torch

    layer = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 1)).sum().backward()
    optimizer.step()
    yield
