"""Custom verifiers for the tests (``RewardSpec.verifier="tests.verifiers:NAME"``): a
module of plain functions, importable by the scoring workers."""

import multiprocessing
import os
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


# Calls of `right_wrong_then_blocks` in this process (a test resets it).
CALLS = [0]


def right_wrong_then_blocks(completion, reference):
    """1, then 0, then blocks: under a scoring deadline shorter than the time limit, the
    third sample times out at the deadline and every later one misses it (serial scoring,
    in order)."""
    CALLS[0] += 1
    if CALLS[0] <= 2:
        return 1.0 if CALLS[0] == 1 else 0.0
    time.sleep(30)
    return 1.0


def dies_in_a_worker(completion, reference):
    """Kills the scoring worker it runs in (as the OOM killer would); 0 in the main process."""
    if multiprocessing.parent_process() is not None:
        os._exit(3)
    return 0.0


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
