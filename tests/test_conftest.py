"""tests/conftest.py's lists of slow tests name files and test functions that exist (a
renamed or moved test would otherwise leave the slow tier silently)."""

import ast
import os

from tests import conftest
from tests.test_imports import parse

HERE = os.path.dirname(os.path.abspath(__file__))


def _test_functions(name):
    with open(os.path.join(HERE, name)) as f:
        tree = parse(f.read(), name)
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_the_slow_lists_name_existing_files_and_tests():
    files = conftest.SLOW_FILES | conftest.PROCESS_FILES
    listed = files.union(*conftest.SLOW_GROUPS)
    for name in listed | set(conftest.SLOWEST_FIRST):
        assert os.path.isfile(os.path.join(HERE, name)), name
    for lists in conftest.SLOW_GROUPS:
        for name, tests in lists.items():
            assert name not in files, name
            missing = tests - _test_functions(name)
            assert not missing, (name, sorted(missing))


def test_every_file_with_slow_tests_keeps_fast_ones():
    """A file whose every test is slow belongs in SLOW_FILES; the others keep a fast tier."""
    for name in set().union(*conftest.SLOW_GROUPS):
        listed = set().union(*(lists.get(name, set()) for lists in conftest.SLOW_GROUPS))
        assert _test_functions(name) - listed, f"every test of {name} is slow"


def test_test_folders_mirror_the_repository():
    """tests/<folder>/ holds the tests of policyopt/<folder>/ (config: policyopt/config/ and
    the recipes of configs/) or of the scripts in <folder>/ (experiments, benchmarks)."""
    root = os.path.dirname(HERE)
    for entry in sorted(os.listdir(HERE)):
        if not os.path.isdir(os.path.join(HERE, entry)) or entry.startswith(("_", ".")):
            continue
        mirrored = os.path.join(root, "policyopt", entry), os.path.join(root, entry)
        assert any(os.path.isdir(path) for path in mirrored), f"tests/{entry}/ mirrors nothing"
        assert os.path.isfile(os.path.join(HERE, entry, "__init__.py")), entry
