"""Training tests: helpers beside this file (tabular_data.py, plugin_models.py) are importable by name;
the uneven dataset and its plain torch run that two files share (torch_uneven.py); two Gloo ranks
that several files' 2-rank calls share (two_ranks)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# MLflow (test_tracking.py) starts usage telemetry, which calls out to the network, when it is
# imported outside a running test (at collection); tests never touch the network.
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"


@pytest.fixture(scope="session")
def uneven_dataset(tmp_path_factory):
    """torch_uneven.UNEVEN, written once for test_torch_backend.py and test_torchrun.py."""
    from tabular_data import write_dataset
    from torch_uneven import UNEVEN

    return write_dataset(str(tmp_path_factory.mktemp("uneven") / "ds"), UNEVEN)


@pytest.fixture(scope="session")
def uneven_torch_run(spark, uneven_dataset, tmp_path_factory):
    """The 2-epoch TorchDistributor run of ``uneven_dataset`` both files compare with: launched once.
    It is given metrics in code (user_code_cells: shipped by value; they change nothing that trains),
    which test_user_code.py holds to one computation over the whole val split."""
    from torch_uneven import TORCH_RUN, torch_config
    from training import train
    from user_code_cells import notebook_code

    code = notebook_code()
    return train(torch_config(uneven_dataset, tmp_path_factory.mktemp("uneven-torch-run"), *TORCH_RUN), spark,
                 metrics=code["metrics"], finalize=code["finalize"])


@pytest.fixture(scope="session")
def two_ranks():
    """Two real Gloo ranks (torch_ranks.RankPool) that the 2-rank strategy and rank-loop runs of
    test_pipeline, test_ft_transformer, test_periodic_sync and test_pipeline_failures share:
    started at the first call, ended at the end of the session."""
    from torch_ranks import RankPool

    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory):
    """``new(directory)`` -> the ``sqlite:///`` URI of an empty MLflow store (tracking and registry) of
    its own in ``directory/mlflow.db``. MLflow takes every new SQLite database through its whole
    schema history (its alembic migrations: the same seconds for every store), so that is done once
    per session, and each store is a copy of that empty, migrated database."""
    import shutil

    pytest.importorskip("mlflow")
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = tmp_path_factory.mktemp("mlflow-store")
    template = root / "mlflow.db"
    store = SqlAlchemyStore(f"sqlite:///{template}", str(root / "artifacts"))
    store.engine.dispose()  # no connection holds the file while it is copied

    def new(directory) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "mlflow.db")
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"

    return new
