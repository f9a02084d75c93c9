"""Custom verifiers for the tests (``RewardSpec.verifier="tests.verifiers:NAME"``): a
module of plain functions, importable by the scoring workers."""

import os
import tempfile
import time


def last_word(completion, reference):
    """1.0 when the completion's last word is the reference: a task with no boxes."""
    words = str(completion).split()
    return 1.0 if words and words[-1] == str(reference) else 0.0


def half_credit(completion, reference):
    return 0.5


def always_correct(completion, reference):
    return True


def sleeps(completion, reference):
    time.sleep(30)
    return 1.0


def naps(completion, reference):
    time.sleep(1.5)
    return 1.0


class _CallCount:
    """A count kept in a file: verifiers run in verifier processes of their own, and a
    test resets it from its process (``CALLS[0] = 0``)."""

    path = os.path.join(tempfile.gettempdir(), f"policyopt-test-verifier-calls-{os.getuid()}")

    def __getitem__(self, index):
        try:
            with open(self.path) as f:
                return int(f.read() or 0)
        except FileNotFoundError:
            return 0

    def __setitem__(self, index, value):
        with open(self.path, "w") as f:
            f.write(str(value))


# Calls of `right_wrong_then_blocks` (a test resets it).
CALLS = _CallCount()


def right_wrong_then_blocks(completion, reference):
    """1, then 0, then blocks: under a scoring deadline shorter than the time limit, the
    third sample times out at the deadline and every later one misses it (serial scoring,
    in order)."""
    CALLS[0] += 1
    if CALLS[0] <= 2:
        return 1.0 if CALLS[0] == 1 else 0.0
    time.sleep(30)
    return 1.0


def says_yes(completion, reference):
    return "yes"


def raises(completion, reference):
    raise KeyError(reference)


not_a_function = 3


def deaf(seconds):
    """Sleeps ``seconds`` with SIGALRM blocked: a stand-in for one C call that never returns
    to the interpreter (no time limit in its process can stop it; only a kill can)."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(seconds)
    return seconds


def odd_length(completion, reference):
    """1.0 when the completion has an odd number of characters: informative groups from a
    random policy (rewards that differ within a group), so that updates have a signal."""
    return float(len(str(completion)) % 2)


def exits(completion, reference):
    """Ends the process it runs in, as a careless verifier's ``sys.exit`` would."""
    import sys

    sys.exit(3)


def interrupts(completion, reference):
    """Raises ``KeyboardInterrupt`` itself: no one pressed Ctrl-C."""
    raise KeyboardInterrupt


def blocks_in_c(completion, reference):
    """Sums 10^12 integers in one C loop: no signal or asynchronous exception stops it."""
    return float(sum(range(10**12)) > 0)


def announce_and_hang(*args):
    """Says "waiting for Ctrl-C" on stdout (verifier processes write to their caller's),
    then sleeps 60 s: a preload, worker initializer or verifier at which a test interrupts
    its caller."""
    print("waiting for Ctrl-C", flush=True)
    time.sleep(60)
    return 1.0
