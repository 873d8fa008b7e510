"""The suite's bounded wait (tests/polling.py) does what the tests lean on: it hands back what the
condition found, and a wait that cannot succeed fails naming what was awaited and why (the
process it depended on ended, with its status and output; the watched job ended; time ran out).

The timeouts here are far beyond anything awaited: a test that passes never waits for them."""

import subprocess
import sys
import threading

import pytest

from polling import wait_for


def test_it_returns_what_the_condition_found():
    seen = iter([None, 0, "", "part-00000.parquet"])
    assert wait_for(lambda: next(seen), "a shard file", timeout=600) == "part-00000.parquet"


@pytest.mark.parametrize("captured", ["pipes", "log"])
def test_a_process_that_ends_first_fails_the_wait_with_its_status_and_output(tmp_path, captured):
    script = "import sys; print('listening on 7077'); sys.exit('no such config: conf/x.yaml')"
    log = tmp_path / "job.log"
    if captured == "pipes":
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    else:
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT)
    with pytest.raises(AssertionError) as info:
        wait_for(lambda: False, "the job to reach its gate", timeout=600, proc=proc,
                 log=log if captured == "log" else None)
    message = str(info.value)
    assert f"(pid {proc.pid}) exited with status 1 while waiting for the job to reach its gate" in message
    assert "listening on 7077" in message and "no such config: conf/x.yaml" in message


def test_a_condition_met_as_the_process_ends_is_not_a_failure(tmp_path):
    marker = tmp_path / "reached"
    proc = subprocess.Popen([sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"])
    proc.wait()  # it wrote the marker, then ended: what was awaited did happen
    assert wait_for(marker.exists, "the marker", timeout=600, proc=proc)


def test_an_abort_fails_the_wait_as_an_exception_a_watcher_thread_can_catch():
    ended = threading.Event()
    ended.set()
    caught = {}

    def watcher():
        try:
            wait_for(lambda: False, "the first checkpoint", timeout=600, abort=ended)
        except Exception as exc:  # noqa: BLE001 - what test_failures' saboteur thread does
            caught["error"] = exc
    thread = threading.Thread(target=watcher)
    thread.start()
    thread.join()
    assert str(caught["error"]) == "the job ended before the first checkpoint"


def test_running_out_of_time_names_what_never_happened_and_the_log(tmp_path):
    log = tmp_path / "master.log"
    log.write_text("BindException: Address already in use")
    with pytest.raises(AssertionError, match=r"timed out after 0s waiting for the Spark master:\n"
                                             r"BindException: Address already in use"):
        wait_for(lambda: False, "the Spark master", timeout=0, log=log)
