"""The command blocks of README.md and of the docs site's pages run as shown, in reading order,
in one fresh folder, and print only shardtrain's own lines: the pages cannot drift from the code.

The pages and their order are tests/doc_pages.py's: README.md, then docs/ as its table of contents
orders them (so the README's quick start runs the demo once, and the pages after it use what it
left). Every fenced ``bash``/``sh`` and ``python`` block is run, unless HTML comments on the lines
just above it say otherwise:

    <!-- readme-test: skip: REASON -->         not run (a real cluster, the test suite itself)
    <!-- readme-test: instead: SHELL LINE -->  this line is run in the block's place
    <!-- readme-test: local: URI_PREFIX -->    (python) URI_PREFIX is replaced by a local folder
    <!-- readme-test: file: PATH -->           (python) the block is saved as PATH in the working
                                               folder, as a reader saves a module; it is not run
    <!-- readme-test: replace: OLD ==> NEW --> the text OLD of the block is run as NEW: the same
                                               commands or calls on a cheaper config (one per comment;
                                               they may stand above or below another marker)

(``<!-- readme-test: config: JOB -->`` above a ``yaml`` block is tests/test_docs.py's: it loads it.)

Shell blocks run line by line (``bash -c``) in one working folder holding a copy of conf/ and a
link to this .venv, so each command sees what the ones above it left. Python blocks run as the
cells of one notebook: in one interpreter (started at the first, with ``spark`` already defined,
kept for the later ones, their globals shared), so they share one driver JVM as a notebook does.

Every step's processes run with one torch thread (``step_env``: OMP_NUM_THREADS=1, what a launch
already gives each of 2 ranks on this 2-core machine): the steps' models are tiny, so a second
thread in an in-process training or a scoring worker only spins, and what a step is checked for
(its exit status and that it prints only shardtrain's own lines) does not depend on threads.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from dataclasses import dataclass

import pytest

from common import __version__
from doc_pages import REPLACE, ROOT, Block, all_blocks, command_lines, page_blocks

SHELL = ("bash", "sh", "shell")
# What a quiet command never prints: Spark's start-up banner, Hadoop's native-library warning,
# console progress bars, any line in log4j's layout, and Python warnings or tracebacks.
NOISE = [
    re.compile(r"Setting default log level to"),
    re.compile(r"To adjust logging level use sc\.setLogLevel"),
    re.compile(r"NativeCodeLoader"),
    re.compile(r"\[Stage \d+:"),
    re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (TRACE|DEBUG|INFO|WARN|ERROR) "),
    re.compile(r"^Traceback \(most recent call last\)"),
    re.compile(r"\w+Warning: "),
]
JOB_COMMANDS = ("shard", "train", "run", "score", "demo", "sweep")
FIRST_LINE = re.compile(rf"INFO shardtrain: shardtrain {re.escape(__version__)} (\w+): config \S+.*; "
                        r"fingerprint [0-9a-f]{12}$")


def noise(output: str) -> list[str]:
    return [line for line in output.splitlines() if any(p.search(line) for p in NOISE)]


def job_command(command: str) -> str | None:
    """``shard`` for '.venv/bin/shardtrain shard --config ...' (None for inspect, doctor, ...)."""
    words = command.split("#")[0].split()
    for i, word in enumerate(words):
        if os.path.basename(word) == "shardtrain":
            rest = [w for w in words[i + 1:] if not w.startswith("-")]
            return rest[0] if rest and rest[0] in JOB_COMMANDS else None
    return None


def step_env() -> dict:
    """The environment of every step's processes (module docstring): the suite's, one torch thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run_shell(command: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=step_env(), capture_output=True, text=True, timeout=900)


# A notebook has a session before its first cell runs; the factory builds it as the CLI does.
SESSION = "from common.spark import get_or_create_session\nspark = get_or_create_session()\n"
# The kernel: runs each cell (a file named on stdin) in one namespace, its output to its own stdout
# and stderr, then writes the cell's status (0, or 1 after printing the traceback) to fd argv[1].
KERNEL = """
import os, sys, traceback
cell = {"__name__": "__main__"}
exec(compile(sys.argv[2], "<prelude>", "exec"), cell)
done = os.fdopen(int(sys.argv[1]), "w")
for path in sys.stdin:
    status = 0
    try:
        exec(compile(open(path.strip()).read(), path.strip(), "exec"), cell)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    done.write(f"{status}\\n")
    done.flush()
if cell.get("spark") is not None:
    cell["spark"].stop()
"""


class Notebook:
    """The pages' python blocks as cells of one notebook, in one interpreter started at the first."""

    def __init__(self, cwd: str, prelude: str = SESSION):
        self.cwd, self.prelude, self.kernel, self.cells = cwd, prelude, None, 0
        self.output = os.path.join(cwd, ".notebook-output")

    def run(self, code: str, timeout: float = 900) -> subprocess.CompletedProcess:
        if self.kernel is None:
            self.done, done_w = os.pipe()
            with open(self.output, "wb") as out:
                self.kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(done_w), self.prelude], cwd=self.cwd,
                                               env=step_env(), stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                               pass_fds=(done_w,), text=True)
            os.close(done_w)
            self.offset = 0
        self.cells += 1
        cell = os.path.join(self.cwd, f".notebook-cell-{self.cells}.py")
        with open(cell, "w", encoding="utf-8") as fh:
            fh.write(code)
        self.kernel.stdin.write(cell + "\n")
        self.kernel.stdin.flush()
        ready, _, _ = select.select([self.done], [], [], timeout)
        status = os.read(self.done, 64).decode().strip() if ready else ""
        returncode = int(status) if status else self.kernel.wait(timeout=60) if ready else -1  # "": it died
        with open(self.output, encoding="utf-8", errors="replace") as out:
            out.seek(self.offset)
            text = out.read()
            self.offset = out.tell()
        if not ready:
            text += f"\n(the cell ran past {timeout} s)"
        return subprocess.CompletedProcess(["notebook cell"], returncode, text, "")

    def close(self) -> None:
        if self.kernel is None:
            return
        self.kernel.stdin.close()
        try:
            self.kernel.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.kernel.kill()
            self.kernel.wait()
        os.close(self.done)


def check_ran(what: str, proc: subprocess.CompletedProcess) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{output[-6000:]}"
    assert not noise(output), f"{what} printed more than shardtrain's own lines:\n" + "\n".join(noise(output))


@dataclass
class Step:
    block: Block
    command: str  # a shell line, or a python block's code

    @property
    def id(self) -> str:
        words = self.command.split("#")[0].split()[:3] if self.block.language != "python" else ["python"]
        return f"{self.block.page}:{self.block.line}-" + "-".join(os.path.basename(w) for w in words)


def readme_steps(blocks: list[Block]) -> list[Step]:
    """What runs, in reading order: each shell line (or its ``instead`` line), each python block."""
    steps = []
    for block in blocks:
        kind, argument = block.marker or ("run", "")
        if block.language not in (*SHELL, "python") or kind == "skip":
            continue
        if block.language == "python":  # a cell to run, or (file:) a module to save
            steps.append(Step(block, block.code()))
        else:
            steps += [Step(block, line) for line in command_lines(argument if kind == "instead" else block.code())]
    return steps


STEPS = readme_steps(all_blocks())


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory):
    """What a fresh clone has after `make setup`: conf/ and .venv (the pages' commands use both).
    One folder for all steps, in order, so each sees what the ones above it left."""
    work = tmp_path_factory.mktemp("readme") / "clone"
    work.mkdir()
    subprocess.run(["cp", "-r", os.path.join(ROOT, "conf"), str(work / "conf")], check=True)
    os.symlink(os.path.dirname(os.path.dirname(sys.executable)), work / ".venv")
    notebook = Notebook(str(work))
    yield {"path": work, "failed": None, "notebook": notebook}
    notebook.close()


def check_markers(blocks: list[Block]) -> None:
    """A marker names its reason or its replacement, and a replacement cannot drop a command's words."""
    for block in blocks:
        if block.marker:
            kind, argument = block.marker
            assert argument, f"{block.where}: 'readme-test: {kind}:' needs a reason or a command"
            assert kind not in ("local", "file") or block.language == "python", f"{block.where}: {kind} is for python"
            assert kind != "config", f"{block.where}: config is for yaml blocks"
        for old, new in block.replacements:
            assert old and new, f"{block.where}: replace is 'OLD{REPLACE}NEW'"
            # A NEW with a shell comment comments out what follows OLD on its line: only a comment may.
            assert "#" not in new or all(re.match(r"[ \t]*(#.*)?$", line.split(old, 1)[1])
                                         for line in block.text.splitlines() if old in line), \
                f"{block.where}: a 'readme-test: replace:' text with a '#' comment must end its line"


def test_every_block_runs_or_says_why_not():
    """A marker names its reason or its replacement; the quick start's demo (once: the pages after
    it use what it left), the tour's three stages, the getting-started checks and the notebook
    snippet are among what runs, README.md's first."""
    check_markers([b for b in all_blocks() if b.language in (*SHELL, "python")])
    commands = [step.command for step in STEPS]
    for expected in ("shardtrain demo", "shardtrain shard --config conf/shard.yaml",
                     "shardtrain train --config conf/train.yaml", "shardtrain score --config conf/score.yaml",
                     "shardtrain doctor"):
        assert any(expected in c for c in commands), (expected, commands)
    assert sum("shardtrain demo" in c for c in commands) == 1, "the demo runs once"
    assert STEPS[0].block.page == "README.md" and "shardtrain demo" in STEPS[0].command
    assert any(step.block.language == "python" for step in STEPS)
    assert {step.block.page for step in STEPS} > {"README.md", "docs/getting-started.md"}


@pytest.mark.spark
@pytest.mark.horovod
@pytest.mark.ranks  # the train step's Horovod ranks, the pipeline step's TorchDistributor ranks
@pytest.mark.parametrize("step", STEPS, ids=[step.id for step in STEPS])
def test_readme_step(step, fresh_copy):
    if fresh_copy["failed"]:
        pytest.fail(f"not run: an earlier step failed ({fresh_copy['failed']})")
    work = fresh_copy["path"]
    where = f"the block at {step.block.where}"
    fresh_copy["failed"] = step.id  # until it passes
    kind, argument = step.block.marker or ("run", "")
    if kind == "file":
        (work / argument).parent.mkdir(parents=True, exist_ok=True)
        (work / argument).write_text(step.command)
    elif step.block.language == "python":
        code = step.command
        if kind == "local":
            local = work / "local-uri"
            local.mkdir(exist_ok=True)
            code = code.replace(argument, str(local))
        check_ran(where, fresh_copy["notebook"].run(code))
    else:
        proc = run_shell(step.command, str(work))
        check_ran(f"{where}: {step.command}", proc)
        job = job_command(step.command)
        if job:
            first = proc.stderr.splitlines()[0] if proc.stderr else ""
            match = FIRST_LINE.search(first)
            assert match and match.group(1) == job, f"{step.command}: first log line {first!r}"
    fresh_copy["failed"] = None


def test_an_unmarked_block_runs_and_a_failing_or_noisy_one_fails(tmp_path):
    """What keeps this honest: a block nobody marked is run, and its failure or Spark chatter fails."""
    readme = tmp_path / "README.md"
    readme.write_text("\n".join([
        "<!-- readme-test: skip: a real cluster -->", "```bash", "spark-submit --master yarn x.py", "```",
        "```bash", "echo ok  # runs", "false", "echo '26/12/01 01:16:15 WARN NativeCodeLoader: Unable to load'", "```",
        "```yaml", "not: a command", "```"]))
    steps = readme_steps(page_blocks(str(readme)))
    assert [step.command for step in steps] == [
        "echo ok  # runs", "false", "echo '26/12/01 01:16:15 WARN NativeCodeLoader: Unable to load'"]
    check_ran("echo", run_shell(steps[0].command, str(tmp_path)))
    # A replacement whose comment would swallow the rest of a command's line is refused.
    readme.write_text("\n".join([
        "<!-- readme-test: replace: shardtrain score ==> shardtrain score x=1  # cheaper -->", "```bash",
        "shardtrain score output.mode=skip_if_exists", "```"]))
    with pytest.raises(AssertionError, match="must end its line"):
        check_markers(page_blocks(str(readme)))
    for step in steps[1:]:
        with pytest.raises(AssertionError):
            check_ran(step.command, run_shell(step.command, str(tmp_path)))


def test_notebook_cells_share_one_interpreter_and_a_failing_cell_fails(tmp_path):
    """The python blocks' notebook: a later cell sees an earlier one's globals in the same process,
    each cell's output is its own, and a cell that raises fails with its traceback."""
    notebook = Notebook(str(tmp_path), prelude="import os\nspark = None\n")
    try:
        first = notebook.run("x = os.getpid()\nprint('first', x)")
        check_ran("first", first)
        second = notebook.run("print('second', x == os.getpid())")
        check_ran("second", second)
        assert first.stdout.split() == ["first", str(notebook.kernel.pid)] and second.stdout.split() == ["second", "True"]
        failing = notebook.run("raise ValueError('no such column: z')")
        assert failing.returncode == 1 and "ValueError: no such column: z" in failing.stdout
        with pytest.raises(AssertionError):
            check_ran("failing", failing)
    finally:
        notebook.close()
    assert notebook.kernel.returncode == 0
