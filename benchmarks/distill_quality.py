"""Does distillation pay when the question is fair? (issue 27) Test accuracy of (a) a student
trained from scratch on a few labelled rows, (b) the same student distilled from a teacher with
an unlabelled transfer set, (c) the teacher, on one generated dataset, in one run; each student's
settings picked by ``shardtrain sweep`` on the validation split, with the same number of trials.

    .venv/bin/python benchmarks/distill_quality.py [--teacher-labels all|student] [--labelled 3000]
        [--unlabelled 15000] [--teacher 256,256] [--widths 32,128,256] [--temperatures 1,4]
        [--trials 8] [--seeds 3] [--steps 1500] [--workdir /tmp/distill-quality]

The data are chosen so a student can represent the function: 8 standard-normal features, the label
the sign of a random Fourier function of them (16 terms, frequencies ~ N(0, 0.7^2)), which a
one-layer MLP of 128 units fits to about 0.90 test accuracy given labels for 32,000 rows (measured
outside the product while choosing the data). The student is short of labels instead: only
``--labelled`` rows carry one for it (split train 0.5 / val 0.2 / test 0.3 by id), ``--unlabelled``
more rows have none.

``--teacher-labels`` says what the teacher knows. ``all`` (the default, the fair question): the
teacher trained on every row's label (the labelled and the unlabelled rows, split by the same id
hash, so it never saw a label of the students' val or test rows); the students see only the
``--labelled`` rows' labels; the distilled one also gets every other row as a transfer set with the
teacher's soft targets. ``student``: the teacher trained on the same labelled rows as the
students (the 2026-12-03 runs' question: there it knew nothing the student could not learn).

The product's pipeline, step by step (what ``shardtrain distill`` with ``soft_targets.unlabeled:
transfer`` composes): shard the teacher's rows, train the teacher, shard the student's rows with
the teacher's soft targets at each ``--temperatures`` value and ``label.unlabeled: transfer`` (the
labelled rows plus every unlabelled row in train, with its soft targets and no label term), and
shard the labelled rows alone (``quarantine``) for the scratch student. Every model trains in
process (world size 1, one torch thread, fp32, AdamW, batch 128, arrow reader): about ``--steps``
optimizer steps for the teacher and the distilled student.

Tuning: ``shardtrain sweep`` (``shardtrain.sweep``, the product's Optuna study; ``launch.mode:
in_process``, ``parallel_trials: 1``, pruner ``none``, objective ``val_accuracy``), with a sweep
config this script writes into the workdir (``*.sweep.yaml``; ``shardtrain sweep --config`` runs
it as it is). Scratch student: ``--trials`` trials over ``model.hidden`` (``--widths``), ``train.lr``
and ``train.epochs`` (a third of the step budget to all of it: many epochs over few rows may
overfit). Distilled student: ``--trials`` trials in all over ``model.hidden``, ``train.lr`` and
``train.distill.alpha``, split evenly over one sweep per temperature (the soft targets are stored
at one temperature per dataset, and training refuses another, so the temperature is the dataset's;
the best trial over those sweeps is picked on val). Trials train at seed 0. The picked settings
then train with ``--seeds`` other seeds; test accuracy is ``load_model(...).predict_arrays`` on
the students' test split (the same rows for every model, the teacher's included), reported as the
mean over seeds with its standard error, and the distilled-minus-scratch difference with its own.
Prints one JSON line per sweep and per trained model, then one summary line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")
# One torch thread: on the shared 2 cores (load average 20+) two threads per step ran 2.5x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

FEATURES, TERMS, FREQUENCY, SEED = 8, 16, 0.7, 0
FRACTIONS = {"train": 0.5, "val": 0.2, "test": 0.3}  # of the labelled rows; unlabelled rows all go to train
BATCH, LR = 128, 0.002
LR_RANGE = (0.0005, 0.008)  # the sweeps' train.lr (log scale), for both students
ALPHA_RANGE = (0.3, 0.95)  # the distilled sweeps' train.distill.alpha (0 is refused with a transfer set)


def write_raw(spark, path: str, labelled: int, unlabelled: int) -> None:
    """id, x0..x7 (standard normal, from hashes of (seed, feature, id)), label_all (0/1, every row)
    and label (the same; null for id >= labelled: the rows the students see without a label)."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    w = rng.normal(0, FREQUENCY, (TERMS, FEATURES))
    b, c = rng.uniform(0, 2 * np.pi, TERMS), rng.normal(0, 1, TERMS)

    def uniform(stream):
        return f"((CAST(xxhash64({SEED}, {stream}, id) & 4503599627370495 AS DOUBLE) + 0.5) / 4503599627370496.0)"

    xs = [f"sqrt(-2 * ln({uniform(2 * i)})) * cos(2 * pi() * {uniform(2 * i + 1)}) AS x{i}" for i in range(FEATURES)]
    terms = [f"{c[k]!r} * sin({' + '.join(f'{w[k, i]!r} * x{i}' for i in range(FEATURES))} + {b[k]!r})"
             for k in range(TERMS)]
    label_all = f"CAST(({' + '.join(terms)}) > 0 AS BIGINT) AS label_all"
    frame = (spark.range(labelled + unlabelled).selectExpr("id", *xs).selectExpr("*", label_all)
             .selectExpr("*", f"CASE WHEN id < {labelled} THEN label_all END AS label"))
    frame.repartition(4).write.mode("overwrite").parquet(path)


def shard_config(raw: str, out: str, teacher: str | None = None, temperature: float = 1.0, label: str = "label"):
    from common.config import from_dict
    from pipelines.shard_config import ShardConfig

    return from_dict(ShardConfig, {
        "sources": {"raw": {"path": raw}}, "features": {"numeric": [f"x{i}" for i in range(FEATURES)]},
        "label": {"column": label, "task": "classification", "num_classes": 2,
                  "unlabeled": "quarantine" if teacher is None else "transfer"},
        "split": {"key": "id", "fractions": FRACTIONS},
        # The scratch student's dataset quarantines the unlabelled rows: most of the input, by design.
        "quality": {"max_bad_fraction": 1.0},
        "output": {"path": out, "num_shards": 2, "mode": "overwrite"},
        **({"teacher": {"model": teacher, "temperature": temperature}} if teacher else {})})


def train_overrides(data: str, hidden: list[int], epochs: int, seed: int, lr: float = LR) -> list[str]:
    return [f"data.path={data}", "launch.mode=in_process", "launch.num_proc=1", f"train.epochs={epochs}",
            f"train.batch_size={BATCH}", f"train.lr={lr}", "train.log_every_steps=100000", f"train.seed={seed}",
            "checkpoint.resume=never", "checkpoint.every_epochs=null", f"model.hidden={hidden}", "data.reader=arrow"]


def train_model(work: str, name: str, data: str, hidden: list[int], epochs: int, seed: int, lr: float = LR,
                *extra: str) -> dict:
    from training import load_train_config, train

    overrides = [*train_overrides(data, hidden, epochs, seed, lr), f"output.model_path={work}/models/{name}",
                 "output.mode=overwrite", *extra]
    result = train(load_train_config(None, overrides))
    return {"model_uri": result.model_uri, "val_accuracy": result.metrics[-1]["val_accuracy"],
            "test_accuracy": test_accuracy(result.model_uri, data), "seconds": round(result.seconds, 1)}


def test_accuracy(model_uri: str, dataset_uri: str) -> float:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.dataset import read_manifest
    from training.columns import columns_for, table_to_arrays
    from training.export import load_model

    manifest = read_manifest(dataset_uri)
    table = pa.concat_tables([pq.read_table(os.path.join(manifest.root.path, f.path)) for f in manifest.files("test")])
    arrays = table_to_arrays(table, columns_for(manifest))
    label = arrays.pop("label")
    arrays.pop("_row")
    return float(np.mean(load_model(model_uri).predict_arrays(arrays).argmax(axis=1) == label))


def sweep_config(work: str, name: str, data: str, space: dict, trials: int, epochs: int, *extra: str) -> str:
    """Write the sweep config of one student's tuning to ``work/NAME.sweep.yaml`` and return its
    path: ``trials`` in-process trials, one at a time, over ``space``, objective val_accuracy."""
    import yaml

    from common.config import apply_overrides

    config = {
        "sweep": {"trials": trials, "parallel_trials": 1, "seed": SEED, "space": space,
                  "objective": {"metric": "val_accuracy", "direction": "maximize"},
                  # Every trial runs its whole budget: the scratch trials differ in epochs, and an
                  # early epoch's accuracy would compare them unevenly.
                  "pruner": {"type": "none"}},
        "output": {"path": f"{work}/sweeps/{name}", "model_path": f"{work}/models/{name}-best", "mode": "overwrite"},
        "train": apply_overrides({}, [*train_overrides(data, [32], epochs, SEED), *extra]),
    }
    path = f"{work}/{name}.sweep.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


def run_sweep(path: str) -> dict:
    """Run the sweep config at ``path`` (a fresh study: an earlier run's directory is removed)
    and return its best trial: params, val_accuracy, and every trial's."""
    from shardtrain.sweep import sweep
    from shardtrain.sweep_config import load_sweep_config

    cfg = load_sweep_config(path)
    shutil.rmtree(cfg.output.path, ignore_errors=True)
    started = time.perf_counter()
    result = sweep(cfg)
    return {"params": result.best.params, "val_accuracy": result.best.value,
            "trials": [{"state": t.state, "val_accuracy": t.value, **t.params} for t in result.trials],
            "seconds": round(time.perf_counter() - started, 1)}


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else float("nan")
    return round(mean, 4), round(math.sqrt(var / n), 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--teacher-labels", choices=("all", "student"), default="all",
                        help="all: the teacher trains on every row's label; student: on the students' labelled rows")
    parser.add_argument("--labelled", type=int, default=3000, help="rows whose label the students see")
    parser.add_argument("--unlabelled", type=int, default=15_000)
    parser.add_argument("--teacher", default="256,256")
    parser.add_argument("--widths", default="32,128,256", help="the sweeps' model.hidden choices (one layer)")
    parser.add_argument("--temperatures", default="1,4", help="one soft-target dataset, and one sweep, each")
    parser.add_argument("--trials", type=int, default=8, help="sweep trials per student (distilled: in all)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps per model (about)")
    parser.add_argument("--workdir", default="/tmp/distill-quality")
    args = parser.parse_args()
    teacher_hidden = [int(h) for h in args.teacher.split(",")]
    widths = [[int(w)] for w in args.widths.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.trials % len(temperatures):
        parser.error(f"--trials ({args.trials}) must split evenly over the {len(temperatures)} temperatures")

    from common.config import SparkConfig
    from common.dataset import read_manifest
    from common.spark import get_or_create_session
    from pipelines import shard_dataset
    from shardtrain.teacher import teacher_scorer

    spark = get_or_create_session(SparkConfig(master="local[2]", app_name="distill_quality",
                                              conf={"spark.sql.shuffle.partitions": 4}), log_level="ERROR")
    work, started = args.workdir, time.perf_counter()
    raw, plain = f"{work}/raw", f"{work}/shards"
    write_raw(spark, raw, args.labelled, args.unlabelled)
    shard_dataset(shard_config(raw, plain), spark=spark)
    teacher_data = plain
    if args.teacher_labels == "all":
        teacher_data = f"{work}/shards-teacher"
        shard_dataset(shard_config(raw, teacher_data, label="label_all"), spark=spark)
    labelled_train, teacher_train = read_manifest(plain).rows("train"), read_manifest(teacher_data).rows("train")

    def epochs_for(rows: int, factor: float = 1.0) -> int:
        return max(1, round(factor * args.steps * BATCH / rows))

    def emit(name: str, record: dict) -> None:
        print(json.dumps({"benchmark": "distill_quality", "model": name,
                          **{k: v for k, v in record.items() if k != "model_uri"}}), flush=True)

    teacher = train_model(work, "teacher", teacher_data, teacher_hidden, epochs_for(teacher_train), SEED)
    # Every model is tested on the students' test rows: the teacher's own test split is larger under `all`.
    teacher["test_accuracy"] = test_accuracy(teacher["model_uri"], plain)
    emit("teacher", teacher)
    soft = {}
    for t in temperatures:
        soft[t] = f"{work}/shards-transfer-t{t:g}"
        shard_dataset(shard_config(raw, soft[t], teacher["model_uri"], t), spark=spark, teacher_scorer=teacher_scorer())
    transfer = read_manifest(soft[temperatures[0]])
    transfer_train = transfer.rows("train")
    shards_seconds = time.perf_counter() - started

    lr_space = {"type": "float", "low": LR_RANGE[0], "high": LR_RANGE[1], "log": True}
    width_space = {"type": "categorical", "choices": widths}
    scratch_epochs = epochs_for(labelled_train)
    sweeps = {"scratch": run_sweep(sweep_config(work, "scratch", plain, {
        "model.hidden": width_space, "train.lr": lr_space,
        "train.epochs": {"type": "int", "low": epochs_for(labelled_train, 1 / 3), "high": scratch_epochs}},
        args.trials, scratch_epochs))}
    for t in temperatures:
        sweeps[f"distilled-t{t:g}"] = run_sweep(sweep_config(work, f"distilled-t{t:g}", soft[t], {
            "model.hidden": width_space, "train.lr": lr_space,
            "train.distill.alpha": {"type": "float", "low": ALPHA_RANGE[0], "high": ALPHA_RANGE[1]}},
            args.trials // len(temperatures), epochs_for(transfer_train), "train.distill.alpha=0.5"))
    for name, record in sweeps.items():
        print(json.dumps({"benchmark": "distill_quality", "sweep": name, **record}), flush=True)
    best_t = max(temperatures, key=lambda t: sweeps[f"distilled-t{t:g}"]["val_accuracy"])
    picked = {"scratch": sweeps["scratch"]["params"],
              "distilled": {**sweeps[f"distilled-t{best_t:g}"]["params"], "temperature": best_t}}

    def scratch(seed: int) -> float:
        p = picked["scratch"]
        record = train_model(work, f"scratch-s{seed}", plain, p["model.hidden"], p["train.epochs"], seed,
                             p["train.lr"])
        emit(f"scratch-s{seed}", {"seed": seed, **record})
        return record["test_accuracy"]

    def distilled(seed: int) -> float:
        p = picked["distilled"]
        record = train_model(work, f"distilled-s{seed}", soft[best_t], p["model.hidden"], epochs_for(transfer_train),
                             seed, p["train.lr"], f"train.distill.alpha={p['train.distill.alpha']}")
        emit(f"distilled-s{seed}", {"seed": seed, **record})
        return record["test_accuracy"]

    seeds = list(range(1, args.seeds + 1))  # not the sweeps' seed 0
    tests = {"scratch": [scratch(s) for s in seeds], "distilled": [distilled(s) for s in seeds]}
    test_rows = transfer.rows("test")
    print(json.dumps({
        "benchmark": "distill_quality", "teacher_labels": args.teacher_labels, "labelled_rows": args.labelled,
        "unlabelled_rows": args.unlabelled,
        "rows": {"teacher_train": teacher_train, "student_labelled_train": labelled_train,
                 "student_train": transfer_train, "transfer": transfer.label.transfer_rows,
                 "val": transfer.rows("val"), "test": test_rows},
        "teacher_hidden": teacher_hidden, "sweep_trials_per_student": args.trials,
        "picked_on_val": picked,
        "val_accuracy_of_picked": {"scratch": sweeps["scratch"]["val_accuracy"],
                                   "distilled": sweeps[f"distilled-t{best_t:g}"]["val_accuracy"]},
        "seeds": seeds,
        "test_accuracy": {"teacher": round(teacher["test_accuracy"], 4),
                          **{k: dict(zip(("mean", "se"), mean_se(v))) for k, v in tests.items()}},
        "distilled_minus_scratch": dict(zip(("mean", "se"), mean_se([d - s for d, s in zip(tests["distilled"],
                                                                                         tests["scratch"])]))),
        "test_set_se_at_teacher": round(math.sqrt(teacher["test_accuracy"] * (1 - teacher["test_accuracy"])
                                                  / test_rows), 4),
        "shard_and_teacher_seconds": round(shards_seconds, 1),
        "sweep_seconds": {k: v["seconds"] for k, v in sweeps.items()},
        "seconds": round(time.perf_counter() - started, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
