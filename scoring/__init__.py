"""shardtrain's third stage: a published model run over Spark tables (``shardtrain score``).

    from scoring import predict_frame, score
    scored = predict_frame(df, "s3://bucket/model", keep_columns=["id"])   # a lazy DataFrame
    result = score("conf/score.yaml", ["output.path=s3://bucket/scores"])  # the whole job

``scoring.predict`` is the core (the shard job's teacher column builds on it); ``scoring.job`` the
job (input, quarantine, accounting, atomic publish); ``scoring.quality`` its check of the input's
null shares against the model's train split; ``scoring.config`` its config tree. It
imports ``common`` (sources, row rules, the model artifact, output modes, devices) and
``training``'s public API (``load_model``) only, never ``pipelines`` or a module inside
``training`` (tests/test_import_graph.py); none of those imports it. Importing it stays cheap and
Spark-free: Python workers import ``scoring.predict``.
"""


def predict_frame(df, model_uri, **options):
    """See scoring.predict.predict_frame."""
    from scoring.predict import predict_frame as _predict_frame

    return _predict_frame(df, model_uri, **options)


def score(config, overrides=None, spark=None):
    """Run the score job (see scoring.job.score); returns a ScoreResult."""
    from scoring.job import score as _score

    return _score(config, overrides, spark)


__all__ = ["predict_frame", "score"]
