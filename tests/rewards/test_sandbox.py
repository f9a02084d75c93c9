"""The sandbox: limits hold, hostile programs are contained, and nothing outlives a run.

Every hostile program runs with a 1 s limit; after each one the scorer must still grade a
correct program. The fork bomb runs under RLIMIT_NPROC (16 processes of a throw-away uid
when the tests run as root), its children call setsid() to leave the process group, and
the test checks that none of them survives.
"""

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from policyopt.rewards import code as code_lib
from policyopt.rewards import code_correctness, run_sandboxed
from policyopt.rewards.sandbox import host, reaper, remove_stale_sandboxes
from policyopt.rewards.sandbox import process as process_lib
from tests.rewards.test_code import (
    ADD_ONE,
    FAST,
    GOOD_TESTS,
    IS_ROOT,
    SUM_STDIN,
    assert_scorer_still_works,
    solution,
)

JAILED = IS_ROOT and process_lib.jail_works(process_lib.sandbox_python())


@pytest.mark.skipif(not JAILED, reason="needs root and mount namespaces (the sandbox's own root)")
def test_a_program_sees_only_its_own_root(tmp_path):
    """The dataset on the host (a world-readable file), the scorer's /proc, a note left
    in /tmp by an earlier run: none of them is visible from the sandbox."""
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"answer": 42}\n')
    os.chmod(tmp_path, 0o755)
    os.chmod(answers, 0o644)
    probe = (
        "import os\nprint(os.path.exists({path!r}), os.path.exists('/proc/1'), "
        "os.path.exists('/tmp/note'), sorted(os.listdir('/')))\n"
        "open('/tmp/note', 'w').write('x')\nprint(os.getcwd(), os.listdir('.'))"
    )
    for _ in range(2):  # the second run would see the first's note
        result = run_sandboxed(probe.format(path=str(answers)), timeout_s=5.0)
        lines = result.stdout.splitlines()
        assert result.returncode == 0, result.stderr
        assert lines[
            0
        ] == "False False False ['bin', 'dev', 'lib', 'lib64', 'sbin', 'tmp', 'usr', 'work']" or (
            lines[0].startswith("False False False [") and "'work'" in lines[0]
        ), lines
        assert lines[1] == "/work []", lines  # main.py is read and deleted before the program
    # The program still runs its standard library and its limits, and is scored.
    assert code_correctness(ADD_ONE, GOOD_TESTS, isolation="process") == 1.0
    assert code_correctness(SUM_STDIN, [{"input": "1 2", "output": "3"}]) == 1.0


@pytest.mark.skipif(not IS_ROOT, reason="files of one user are readable by that user's programs")
def test_a_program_cannot_read_other_runs_files():
    """The tests' process writes its stdout / stderr (assert messages) to files only the
    scorer can read: the program's process runs beside it and must not read them."""
    program = solution(
        "import glob\ndef readable():\n    count = 0\n"
        "    for path in glob.glob('/tmp/policyopt-sandbox-*/*'):\n"
        "        try:\n            open(path).read()\n            count += 1\n"
        "        except OSError:\n            pass\n    return count"
    )
    assert code_correctness(program, "assert readable() == 0", isolation="process") == 1.0


def test_infinite_loop_is_killed():
    start = time.perf_counter()
    assert code_correctness(solution("while True:\n    pass"), GOOD_TESTS, **FAST) == 0.0
    assert time.perf_counter() - start < 3.0
    sleeper = run_sandboxed("import time\ntime.sleep(60)", **FAST)  # wall clock, not CPU
    assert sleeper.timed_out
    assert_scorer_still_works()


def test_memory_hog_is_contained():
    start = time.perf_counter()
    hog = solution("blob = bytearray(2 << 30)\ndef add_one(x):\n    return x + 1")
    assert code_correctness(hog, GOOD_TESTS, memory_mb=300, **FAST) == 0.0
    grower = solution("chunks = []\nwhile True:\n    chunks.append(' ' * 10**7)")
    assert code_correctness(grower, GOOD_TESTS, memory_mb=300, **FAST) == 0.0
    result = run_sandboxed("x = bytearray(2 << 30)", memory_mb=300, **FAST)
    assert "MemoryError" in result.stderr
    assert time.perf_counter() - start < 6.0
    assert_scorer_still_works()


def _live_processes_after_grace(uid: int, grace_s: float = 2.0) -> list[int]:
    """Live (non-zombie) processes of ``uid``, after up to ``grace_s`` for exits to land."""
    deadline = time.monotonic() + grace_s
    while (pids := reaper.live_processes(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


@pytest.mark.skipif(
    not IS_ROOT, reason="children that call setsid() are reaped only under a private uid"
)
def test_fork_bomb_is_bounded_and_reaped():
    bomb = (
        "import os, time\n"
        "for _ in range(10000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()  # leave the process group\n"
        "    except OSError:\n"
        "        break\n"
        "time.sleep(30)\n"
    )
    start = time.perf_counter()
    result = run_sandboxed(bomb, max_processes=8, **FAST)
    assert result.timed_out
    assert time.perf_counter() - start < 5.0
    assert result.uid in host.SANDBOX_UIDS
    assert _live_processes_after_grace(result.uid) == []
    assert_scorer_still_works()


def test_process_count_limit_applies():
    program = (
        "import os\n"
        "children = 0\n"
        "for _ in range(50):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        import time; time.sleep(5); os._exit(0)\n"
        "    children += 1\n"
        "print(children)\n"
    )
    result = run_sandboxed(program, max_processes=6, timeout_s=2.0)
    if IS_ROOT:  # the uid is private to the run: exactly max_processes - 1 children fit
        assert result.stdout.strip() == "5"
    else:
        assert int(result.stdout.strip()) < 50


@pytest.mark.skipif(not IS_ROOT, reason="file isolation relies on switching to an unprivileged uid")
def test_cannot_write_outside_its_directory(tmp_path):
    target = tmp_path / "escaped.txt"
    program = (
        "import os\n"
        f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError:\n    print('blocked')\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read())\n"
    )
    result = run_sandboxed(program, **FAST)
    assert result.stdout.split() == ["blocked", "fine"]
    assert not target.exists()
    assert_scorer_still_works()


def test_cannot_read_parent_environment(monkeypatch):
    monkeypatch.setenv("POLICYOPT_TEST_SECRET", "s3cret-value")
    result = run_sandboxed("import os\nprint(sorted(os.environ.items()))", **FAST)
    assert result.returncode == 0 and "s3cret" not in result.stdout
    peek = solution("import os\nSECRET = os.environ.get('POLICYOPT_TEST_SECRET')")
    assert code_correctness(peek, "assert SECRET == 's3cret-value'", **FAST) == 0.0
    if IS_ROOT:  # nor the scorer's environment block through /proc
        snoop = (
            "import os\ntry:\n    open(f'/proc/{os.getppid()}/environ').read()\n"
            "except OSError:\n    print('blocked')"
        )
        assert run_sandboxed(snoop, **FAST).stdout.strip() == "blocked"


def test_huge_output_is_capped():
    start = time.perf_counter()
    result = run_sandboxed("while True:\n    print('x' * 100000)", max_output_bytes=1 << 16, **FAST)
    assert len(result.stdout) <= 1 << 16 and result.returncode != 0
    assert time.perf_counter() - start < 3.0
    flood = solution("import sys\nwhile True:\n    sys.stdout.write('y' * 10**6)")
    assert code_correctness(flood, [{"input": "", "output": "y"}], **FAST) == 0.0
    assert_scorer_still_works()


def test_limits_cannot_be_raised():
    program = (
        "import resource\n"
        "try:\n"
        "    resource.setrlimit(resource.RLIMIT_CPU, (1000, 1000))\n"
        "    print('raised')\n"
        "except (ValueError, OSError):\n"
        "    print('blocked')\n"
    )
    assert run_sandboxed(program, **FAST).stdout.strip() == "blocked"


@pytest.mark.skipif(not host.unshare_prefix(), reason="no network namespace available on this host")
def test_network_is_unreachable():
    program = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(0.5)\n"
        "print(s.connect_ex(('10.255.255.1', 80)) != 0)\n"
        "print(len(socket.if_nameindex()))\n"
    )
    result = run_sandboxed(program, **FAST)
    assert result.stdout.split() == ["True", "1"]  # only the loopback interface exists


# The program (6,000 files of 1 MiB scored 1 and took 5.9 GB of the host's disk),
# scaled to the small limit of the test: it writes until something stops it.
FILLS_ITS_DIRECTORY = solution(
    "import os\n"
    "size = os.statvfs('.').f_blocks * os.statvfs('.').f_frsize\n"
    "print('cwd bytes', size, flush=True)\n"
    "for i in range(6000):\n"
    "    with open(f'f{i}', 'wb') as f:\n"
    "        f.write(b'x' * (1 << 20))\n"
    "def add_one(x):\n    return x + 1"
)
MANY_FILES = solution(
    "for i in range(6000):\n    open(f'f{i}', 'w').close()\ndef add_one(x):\n    return x + 1"
)
JAIL_MODES = [
    pytest.param(True, marks=pytest.mark.skipif(not JAILED, reason="no jail here")),
    False,
]


def _python_without_jail() -> str:
    """An interpreter the sandbox uid can read outside a jail: the jail binds the scorer's
    own into its root (it may sit in root's home, e.g. pyenv); without one the uid needs
    a world-readable one."""
    for python in ([sys.executable] if not IS_ROOT else []) + ["/usr/bin/python3"]:
        if os.path.exists(python):
            return python
    pytest.skip("no world-readable interpreter for a sandbox uid without a jail")


@pytest.fixture
def sandbox_roots(monkeypatch):
    """A directory of its own for the sandboxes' roots (traversable by their uids), to see
    what they leave behind."""
    roots = tempfile.mkdtemp(prefix="policyopt-test-roots-")
    os.chmod(roots, 0o711)
    monkeypatch.setattr(tempfile, "tempdir", roots)
    yield roots
    shutil.rmtree(roots, ignore_errors=True)


@pytest.mark.parametrize("jail", JAIL_MODES, ids=["jail", "no_jail"])
@pytest.mark.parametrize("program", [FILLS_ITS_DIRECTORY, MANY_FILES], ids=["bytes", "files"])
@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_program_that_fills_its_directory_scores_0(
    jail, program, isolation, monkeypatch, sandbox_roots
):
    """In a jail the working directory is a tmpfs of reward.code_disk_mb (writes past it
    fail in the program: ENOSPC); without one the scorer kills the program once its
    directory on disk passes the size or MAX_FILES. Either way it scores 0, the host's
    disk holds at most one poll's worth, and nothing is left behind."""
    monkeypatch.setattr(process_lib, "jail_works", lambda python: jail)
    if not jail:
        monkeypatch.setattr(process_lib, "sandbox_python", _python_without_jail)
    result = code_lib.run_code_tests(
        program, GOOD_TESTS, isolation=isolation, disk_mb=8, timeout_s=20.0
    )
    assert result.status == "incorrect" and result.passed == 0
    assert os.listdir(sandbox_roots) == []
    # The honest program under the same limits.
    assert (
        code_lib.run_code_tests(ADD_ONE, GOOD_TESTS, isolation=isolation, disk_mb=8).status
        == "correct"
    )


@pytest.mark.skipif(not JAILED, reason="no jail here")
def test_the_jails_working_directory_is_a_tmpfs_of_code_disk_mb():
    result = run_sandboxed(
        "import os\ns = os.statvfs('.')\nprint(s.f_blocks * s.f_frsize, s.f_files)\n"
        "n = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(b'x' * (1 << 20))\n"
        "        n += 1\nexcept OSError as e:\n    print(n, e.errno)\n",
        timeout_s=10.0,
        disk_mb=8,
        max_output_bytes=2 << 20,
    )
    size, inodes, written, errno = (int(x) for x in result.stdout.split())
    assert size == 8 << 20 and inodes == 4096 and errno == 28  # ENOSPC
    assert written == 7 or written == 8  # 1 MiB files in 8 MiB (a last partial one fails)


def test_without_a_jail_the_scorer_kills_a_program_past_the_limit(sandbox_roots):
    program = (
        "import time\nfor i in range(6000):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
        "print('done')\n"
    )
    start = time.perf_counter()
    result = run_sandboxed(
        program,
        timeout_s=20.0,
        disk_mb=8,
        jail=False,
        max_output_bytes=2 << 20,
        python=_python_without_jail(),
    )
    assert result.disk_exceeded and not result.timed_out and result.returncode == -9
    assert "done" not in result.stdout and "passed 8 MB or 4096 files" in result.stderr
    assert time.perf_counter() - start < 10 and os.listdir(sandbox_roots) == []


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_directory_filled_between_two_polls_still_scores_0(isolation, monkeypatch, sandbox_roots):
    """A program that writes its files and ends within one poll's interval (the polls made
    rare here; a loaded machine did it at 20 ms) is caught by the check after it ends."""
    monkeypatch.setattr(process_lib, "jail_works", lambda python: False)
    monkeypatch.setattr(process_lib, "sandbox_python", _python_without_jail)
    monkeypatch.setattr(process_lib, "DISK_POLL_S", 60.0)
    result = code_lib.run_code_tests(
        MANY_FILES, GOOD_TESTS, isolation=isolation, disk_mb=8, timeout_s=20.0
    )
    assert result.status == "incorrect" and result.passed == 0
    assert os.listdir(sandbox_roots) == []


# Every process a sandbox starts dies with it: at the end of its sample, at a deadline kill
# and with its scorer. The program below leaves three kinds behind: a child that left the
# process group (setsid), a daemon (double fork) and a small fork bomb whose children
# leave the group and fork again. Each ends in `sleep MARK`, so the test finds them by
# their command line, whatever uid or cgroup they run in, and a sleeping process never
# reaches its CPU limit.
SLEEP = shutil.which("sleep", path="/usr/bin:/bin") or "/bin/sleep"


def leaves_children(mark: str, then: str) -> str:
    """A program that starts the three kinds of children, prints "started", then runs
    ``then``."""
    return (
        "import os, sys\n"
        f"def sleeper():\n    os.execv({SLEEP!r}, ['sleep', {mark!r}])\n"
        "def fork():  # a child (True) or the parent (False); None past the process limit\n"
        "    try:\n        return os.fork() == 0\n    except OSError:\n        return None\n"
        "if fork():\n    os.setsid()\n    sleeper()\n"
        "if fork():\n    os.setsid()\n    if fork():\n        sleeper()\n    os._exit(0)\n"
        "for _ in range(20):\n"
        "    child = fork()\n"
        "    if child is None:\n        break\n"
        "    if child:\n        os.setsid()\n        fork()\n        sleeper()\n"
        "print('started', flush=True)\n" + then
    )


def marked_processes(mark: str) -> list[int]:
    """Live (non-zombie) processes whose command line is ``sleep <mark>``."""
    wanted, pids = f"sleep\0{mark}\0".encode(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if f.read() != wanted:
                    continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
        except (OSError, IndexError):
            continue
        pids.append(int(entry.name))
    return pids


def wait_for(condition, timeout_s: float, poll_s: float = 0.05):
    """Polls ``condition()`` until it is truthy or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return value


def new_mark() -> str:
    """A sleep duration no other process uses: the children's command line."""
    return f"{3000 + int.from_bytes(os.urandom(3), 'big') / 1e4:.4f}"


@pytest.mark.parametrize(
    "groups",
    [
        pytest.param(
            True,
            marks=pytest.mark.skipif(not process_lib.cgroup.support().kills, reason="no groups"),
        ),
        pytest.param(False, marks=pytest.mark.skipif(not IS_ROOT, reason="setsid children escape")),
    ],
    ids=["control_groups", "uid_only"],
)
def test_nothing_a_sample_started_outlives_it(groups, monkeypatch):
    """The program exits right after starting its children: when its run returns, they
    die (within 5 s), whether they left the process group or not; with control groups,
    and without them (as root: by their uid)."""
    import threading

    if not groups:
        monkeypatch.setattr(process_lib.cgroup, "support", process_lib.cgroup.Support)

    mark, seen, stop = new_mark(), [], threading.Event()

    def watch():  # sees the children while the run is going on
        while not stop.is_set() and not seen:
            seen.extend(marked_processes(mark))
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        result = run_sandboxed(
            leaves_children(mark, "import time\ntime.sleep(1.0)\n"), timeout_s=20.0
        )
    finally:
        stop.set()
        thread.join()
    assert result.returncode == 0 and result.stdout.strip() == "started", result
    assert seen, "the program's children never ran"
    assert wait_for(lambda: not marked_processes(mark), 5.0), marked_processes(mark)


def test_nothing_a_sample_started_outlives_a_deadline_kill():
    """score_batch's deadline kills the scoring worker mid-test: the test's processes die
    with it (the issue: a fork bomb's processes were alive 110 s later)."""
    from policyopt.rewards import RewardSpec, score_batch, start_workers
    from policyopt.rewards.scoring import kill_pool

    mark = new_mark()
    program = solution(leaves_children(mark, "import time\ntime.sleep(120)\n"))
    start_workers(1, pool="sandbox-deadline")
    try:
        result = score_batch(
            [program],
            ["assert True"],
            [1],
            RewardSpec(task="code", code_timeout_s=120.0),
            num_workers=1,
            deadline_s=6.0,
            pool="sandbox-deadline",
        )
        assert result.status == ["deadline"], (result.status, result.metrics)
        assert wait_for(lambda: not marked_processes(mark), 5.0), marked_processes(mark)
    finally:
        kill_pool(1, "sandbox-deadline")


def _scorer_with_children(mark: str) -> subprocess.Popen:
    """A scorer process running the program, once its children run."""
    program = leaves_children(mark, "import time\ntime.sleep(120)\n")
    script = (
        f"from policyopt.rewards import run_sandboxed\nrun_sandboxed({program!r}, timeout_s=120)"
    )
    scorer = subprocess.Popen([sys.executable, "-c", script])
    if not wait_for(lambda: len(marked_processes(mark)) >= 3, 60.0):
        scorer.kill()
        scorer.wait()
        pytest.fail("the sandboxed program's children never ran")
    return scorer


def test_nothing_a_sample_started_outlives_its_scorer():
    """A scorer SIGKILLed (a trainer killed, a worker killed by the OOM killer) mid-test:
    every process of its sandbox dies within 5 s, and its directory goes."""
    mark = new_mark()
    scorer = _scorer_with_children(mark)
    scorer.kill()
    scorer.wait()
    assert wait_for(lambda: not marked_processes(mark), 5.0), marked_processes(mark)
    leftover = glob.glob(os.path.join(tempfile.gettempdir(), f"policyopt-sandbox-{scorer.pid}-*"))
    assert wait_for(lambda: not any(os.path.exists(p) for p in leftover), 5.0), leftover


def test_the_start_up_sweep_kills_what_a_dead_scorer_left():
    """When nothing watched the dead scorer (its watcher killed too), the next scorer's
    start-up sweep kills the processes its sandboxes left."""
    mark = new_mark()
    scorer = _scorer_with_children(mark)
    for pid in supervisors_of(scorer.pid):
        os.kill(pid, 9)
    scorer.kill()
    scorer.wait()
    time.sleep(0.5)
    remove_stale_sandboxes()
    assert wait_for(lambda: not marked_processes(mark), 5.0), marked_processes(mark)


def supervisors_of(scorer_pid: int) -> list[int]:
    """The processes that watch the scorer ``scorer_pid`` for its death (none before they
    existed): their command line names the scorer's pid."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"policyopt-sandbox-supervisor" in argv and str(scorer_pid).encode() in argv:
            found.append(int(entry.name))
    return found


# Ten children of 100 MB each: 1 GB together, under a limit of 300 MB (the issue: 1.6 GB
# under memory_mb=300, the limit being per process). Each child holds its memory until
# the parent has counted the children alive.
CHILDREN_OF_100_MB = (
    "import os, select, time\n"
    "ready_r, ready_w = os.pipe()\n"
    "children = []\n"
    "for _ in range(10):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        block = bytearray(100 << 20)\n"
    "        for i in range(0, len(block), 4096):\n"
    "            block[i] = 1\n"
    "        os.write(ready_w, b'x')\n"
    "        time.sleep(60)\n"
    "        os._exit(0)\n"
    "    children.append(pid)\n"
    "ready = 0\n"
    "while ready < 10 and select.select([ready_r], [], [], 3.0)[0]:\n"
    "    ready += len(os.read(ready_r, 10))  # until all hold theirs, or 3 s without news\n"
    "time.sleep(1.0)  # for the kills under way to land\n"
    "print(sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in children), flush=True)\n"
)


@pytest.mark.skipif(
    not process_lib.cgroup.support().limits_memory,
    reason="no control group with a memory limit here: memory_mb is per process",
)
def test_the_memory_limit_covers_the_programs_children():
    """memory_mb bounds the program and its children together: of ten children holding
    100 MB each under memory_mb=300 (and 8 MB of files), at most three are alive at once."""
    result = run_sandboxed(CHILDREN_OF_100_MB, memory_mb=300, disk_mb=8, timeout_s=40.0)
    held = int(result.stdout.split()[0]) if result.stdout.split() else 0
    assert held <= 3, (held, result)
    assert result.memory_exceeded, result  # the kernel killed some: not a timeout
    assert not result.timed_out
    # An honest program under the same limits is not bothered.
    fits = run_sandboxed(CHILDREN_OF_100_MB.replace("100 << 20", "20 << 20"), memory_mb=300)
    assert fits.stdout.split() == ["10"] and not fits.memory_exceeded, fits
