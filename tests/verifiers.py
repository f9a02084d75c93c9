"""Custom verifiers for the tests (``RewardSpec.verifier="tests.verifiers:NAME"``): a
module of plain functions, importable by the scoring workers."""

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


def says_yes(completion, reference):
    return "yes"


def raises(completion, reference):
    raise KeyError(reference)


not_a_function = 3
