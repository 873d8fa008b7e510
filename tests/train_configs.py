"""The suite's one builder of training configs: what every test training states (which dataset,
where the model goes, how the ranks launch), as the ``key=value`` overrides a user types, so the
same list serves ``load_train_config`` in-process and ``shardtrain train`` on a command line.

Every test directory can import it by name (tests/conftest.py puts tests/ on sys.path). What a test
chooses for itself (epochs, batch size, model size, timeouts) stays in the test, passed as
``overrides``: the builder adds no sizes of its own.
"""

from __future__ import annotations


def train_overrides(dataset, model_path, *overrides: str, ranks: int | None = 1) -> list[str]:
    """The overrides of a test training of ``dataset`` (a URI or path, or anything with a ``uri``,
    e.g. ``tabular_data.write_dataset``'s result) that publishes its model at ``model_path``.

    ``ranks``: 1 trains in the test's own process (``launch.mode=in_process``,
    ``launch.num_proc=1``); N > 1 launches N ranks on Spark (``launch.num_proc=N``, the launcher and
    its timeouts as configured); None leaves the launch keys to the config file or their defaults.
    ``overrides`` come last, in order, so a test's own key wins over anything above.
    """
    uri = getattr(dataset, "uri", dataset)
    if ranks is None:
        launch = []
    elif ranks == 1:
        launch = ["launch.mode=in_process", "launch.num_proc=1"]
    else:
        launch = [f"launch.num_proc={ranks}"]
    return [f"data.path={uri}", f"output.model_path={model_path}", *launch, *overrides]


def train_config(dataset, model_path, *overrides: str, ranks: int | None = 1):
    """The typed ``TrainConfig`` of :func:`train_overrides` (no config file: the defaults below them)."""
    from training import load_train_config

    return load_train_config(None, train_overrides(dataset, model_path, *overrides, ranks=ranks))
