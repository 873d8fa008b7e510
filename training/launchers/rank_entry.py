"""What every launcher's rank runs around the training itself, and the record a rank sends back.

``run_rank_entry`` is the one rank-entry sequence of all launchers: build the ``Reporter`` (the
rank's link to the driver, ``training.launchers.progress``), start the rank group, train, and end
with one last report; it never lets an exception escape. A failure comes back as a plain
``RankFailure`` record with the rank's own traceback (an executor's exception class may not even
import on the driver), so the driver can say what went wrong instead of showing a bare
Py4JJavaError. ``check_results`` turns the records back into results or a ``RankFailedError``.

Rank side: imports only ``common`` and the standard library at import time; the launcher's
``start_group`` / ``train`` import torch or horovod when they run.
"""

from __future__ import annotations

import logging
import traceback
from typing import Callable

from common.errors import EXIT_RUNTIME, RankFailedError, RankFailure, ShardtrainError
from common.faults import fault_point
from training.launchers.failure_policy import is_secondary
from training.launchers.progress import Reporter

log = logging.getLogger("shardtrain.train")


def run_rank_entry(plan, rank: int, start_group: Callable, train: Callable,
                   stop_group: Callable | None = None) -> dict:
    """One rank, start to end (``rank``: what the launcher's environment says, until the group
    is up): ``start_group(plan) -> group``, then ``train(plan, group, reporter)
    -> dict`` (the rank loop with the reporter's hooks), then ``stop_group(group)`` if given (also
    after a failure, once the failure has been reported). Returns ``{"ok": True, ...}`` or
    ``{"ok": False, "failure": <RankFailure as a dict>}``."""
    reporter = Reporter.from_env(rank, plan.steps_per_epoch)
    group = None
    try:
        group = start_group(plan)
        rank = group.rank  # the group's word from here on (an elastic rank keeps its first one)
        result = {"ok": True, **train(plan, group, reporter)}
        fault_point(f"rank{rank}", "after-run")  # the tests' one way to kill a rank just after its publish
        reporter.finished(None)
        return result
    except BaseException as exc:  # noqa: BLE001 - reported to the driver as data, see the module docstring
        record = failure_record(rank, exc, traceback.format_exc())
        reporter.finished(f"{record.type}: {record.message}", record.secondary)
        return {"ok": False, "failure": record.to_dict()}
    finally:
        if group is not None and stop_group is not None:
            try:
                stop_group(group)
            except Exception as exc:  # noqa: BLE001 - the rank's record is what matters; say it, keep it
                log.warning("rank %d: stopping its group failed: %s", rank, exc)


def failure_record(rank: int, exc: BaseException, text: str) -> RankFailure:
    """``exc`` (with its traceback ``text``) as the plain record a rank sends to the driver."""
    exit_code = exc.exit_code if isinstance(exc, ShardtrainError) else EXIT_RUNTIME
    message = str(exc).strip().splitlines()[0] if str(exc) else ""
    return RankFailure(rank=rank, type=type(exc).__name__, message=message, traceback=text, exit_code=exit_code,
                       secondary=is_secondary(type(exc).__name__, str(exc)))


def exchange_results(master_addr: str, master_port: int, world: int, rank: int, key_prefix: str, result: dict,
                     timeout: int) -> list[dict] | None:
    """Every rank's result to rank 0 through torchrun's store (keys ``<key_prefix>/<rank>``); rank 0
    returns the list, with a failure record for a rank that sent nothing within ``timeout`` s, and
    the other ranks None."""
    import datetime
    import pickle

    import torch.distributed as dist

    store = dist.TCPStore(master_addr, master_port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    store.set(f"{key_prefix}/{rank}", pickle.dumps(result))
    if rank != 0:
        return None
    results = []
    for other in range(world):
        key = f"{key_prefix}/{other}"
        try:
            store.wait([key])
            results.append(pickle.loads(store.get(key)))
        except Exception as exc:  # noqa: BLE001 - a rank that died without a word
            text = f"rank {other} sent no result within {timeout}s: {exc}"
            results.append({"ok": False, "failure": failure_record(other, RuntimeError(text), text).to_dict()})
    return results


def check_results(results: list[dict]) -> list[dict]:
    """The ranks' results, or one ``RankFailedError`` carrying every failed rank's record."""
    failures = [RankFailure(**r["failure"]) for r in results if not r.get("ok")]
    if failures:
        raise RankFailedError(failures)
    return results


__all__ = ["check_results", "exchange_results", "failure_record", "run_rank_entry"]
