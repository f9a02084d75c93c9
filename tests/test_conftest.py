"""tests/conftest.py's lists of slow tests name files and test functions that exist (a
renamed or moved test would otherwise leave the slow tier silently)."""

import ast
import os

from tests import conftest

HERE = os.path.dirname(os.path.abspath(__file__))


def _test_functions(name):
    with open(os.path.join(HERE, name)) as f:
        tree = ast.parse(f.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_the_slow_lists_name_existing_files_and_tests():
    for name in conftest.SLOW_FILES | set(conftest.SLOW_TESTS) | set(conftest.SLOWEST_FIRST):
        assert os.path.isfile(os.path.join(HERE, name)), name
    for name, tests in conftest.SLOW_TESTS.items():
        assert name not in conftest.SLOW_FILES, name
        missing = tests - _test_functions(name)
        assert not missing, (name, sorted(missing))
