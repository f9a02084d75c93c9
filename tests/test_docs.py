"""Every citation in the repository resolves inside it: docs/algorithms.md sections named
by the code exist, and no file points at source material outside the repository."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = os.path.join(ROOT, "docs", "algorithms.md")
# A section cited as docs/algorithms.md "Name" or docs/algorithms.md, "Name".
SECTION_CITE = re.compile(r'docs/algorithms\.md,? "([^"]+)"')
# What the repository must not point at: the maintainers' notes outside it.
OUTSIDE = re.compile(r"PAPERS\.md|\.\./shared/|/work/(?:shared|main|wt)/")


def _tracked_text_files():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout (an sdist): walk the tree
        paths = [
            os.path.relpath(os.path.join(d, f), ROOT)
            for d, _, files in os.walk(ROOT)
            if "/." not in d
            for f in files
        ]
    else:
        paths = listed.stdout.split()
    for path in paths:
        if path.endswith((".py", ".md", ".ini", ".cfg", ".toml", ".sh")) or path == "Makefile":
            full = os.path.join(ROOT, path)
            if os.path.isfile(full):
                with open(full, encoding="utf-8") as f:
                    yield path, f.read()


def test_cited_sections_of_the_algorithms_page_exist():
    with open(ALGORITHMS, encoding="utf-8") as f:
        headings = [line[3:].strip() for line in f if line.startswith("## ")]
    cited = {}
    for path, text in _tracked_text_files():
        if path == "tests/test_docs.py":  # its own examples
            continue
        for name in SECTION_CITE.findall(text):
            cited.setdefault(name, path)
    assert cited, "no file cites a section of docs/algorithms.md"
    missing = {
        name: path
        for name, path in cited.items()
        if not any(h == name or h.startswith(name + " ") for h in headings)
    }
    assert not missing, f"sections cited but absent from docs/algorithms.md: {missing}"


def test_nothing_points_outside_the_repository():
    offenders = [
        f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for path, text in _tracked_text_files()
        if path != "tests/test_docs.py"
        for m in OUTSIDE.finditer(text)
    ]
    assert not offenders, offenders
