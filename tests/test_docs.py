"""Every citation in the repository resolves inside it: docs/algorithms.md sections and
benchmarks/RESULTS.md / HISTORY.md sections named by the code exist, no file points at
source material outside the repository, and no text cites the lab diary's ordinals."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = os.path.join(ROOT, "docs", "algorithms.md")
# A section cited as docs/algorithms.md "Name" or docs/algorithms.md, "Name".
SECTION_CITE = re.compile(r'docs/algorithms\.md,? "([^"]+)"')
# What the repository must not point at: the maintainers' notes outside it.
OUTSIDE = re.compile(r"PAPERS\.md|\.\./shared/|/work/(?:shared|main|wt)/")
# A benchmark section cited by heading, `benchmarks/HISTORY.md "2026-12-02: the engine"` (a
# prefix of the heading; RESULTS or HISTORY, with or without the folder and `.md`, a comma
# allowed), or by date, `benchmarks/HISTORY.md, 2026-12-02`.
BENCH_CITE = re.compile(
    r'\b(RESULTS|HISTORY)(?:\.md)?`?,?\s*(?:"([^"]{1,160})"|(\d{4}-\d\d-\d\d)\b)'
)
# The lab diary's ordinals ("Fourteenth session", "the twenty-second ..."): meaningless to a
# reader; a date, a command or a section says the same.
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    "twenty-\\w+|thirtieth"
)
DIARY = re.compile(
    rf"(?i)\b(?:{ORDINALS})(?:'s)?\s+(?:session|sessions)\b|\bsessions?\s+(?:{ORDINALS})\b"
)


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


def _headings(path: str) -> list[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [line.lstrip("#").strip() for line in f if re.match(r"#{2,3} ", line)]


def _citation_text(text: str) -> str:
    """A quoted heading as the text holds it, folded: line breaks, comment and docstring
    indentation and ``#`` markers between its words collapsed to one space."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text).strip()


def test_cited_benchmark_sections_exist():
    headings = {
        "RESULTS": _headings("benchmarks/RESULTS.md"),
        "HISTORY": _headings("benchmarks/HISTORY.md"),
    }
    missing, cited = [], 0
    for path, text in _tracked_text_files():
        if path == "tests/test_docs.py":
            continue
        for m in BENCH_CITE.finditer(text):
            name, date = m.group(2), m.group(3)
            found = headings[m.group(1)]
            line = text.count("\n", 0, m.start()) + 1
            if name is not None:
                name = _citation_text(name)
                ok = any(h == name or h.startswith(name) for h in found)
            else:
                ok = any(h.startswith(date) for h in found)
            cited += 1
            if not ok:
                missing.append(f"{path}:{line}: {m.group(0)!r}")
    assert cited, "no file cites a section of benchmarks/RESULTS.md or HISTORY.md"
    assert not missing, missing


def test_history_is_headed_by_date():
    with open(os.path.join(ROOT, "benchmarks", "HISTORY.md"), encoding="utf-8") as f:
        sections = [line[3:].strip() for line in f if line.startswith("## ")]
    assert sections
    for heading in sections:
        assert re.match(r"\d{4}-\d\d-\d\d: ", heading), heading


def test_no_diary_ordinals():
    offenders = [
        f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for path, text in _tracked_text_files()
        if path != "tests/test_docs.py"
        for m in DIARY.finditer(text)
    ]
    assert not offenders, offenders


# Pages other changes add; a link to one that has not landed yet is not an error. Empty
# this set once they have.
PENDING_PAGES = {"docs/lora.md"}
# A relative Markdown link: [text](target), the target without a scheme or an anchor alone.
LINK = re.compile(r"\[[^\]]*\]\((?!https?:|mailto:|#)([^)#\s]+)(?:#[^)]*)?\)")


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _user_pages() -> list[str]:
    pages = sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")))
    return ["README.md", *(p for p in pages if p.endswith(".md"))]


def test_readme_fits_on_a_screen_or_two():
    lines = _read("README.md").count("\n")
    assert lines <= 150, f"README.md has {lines} lines; the manual belongs in docs/"


def test_readme_links_every_docs_page():
    readme = _read("README.md")
    linked = {os.path.normpath(target) for target in LINK.findall(readme)}
    pages = [p for p in _user_pages() if p != "README.md"]
    assert pages, "no docs/*.md"
    missing = [p for p in pages if p not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_relative_links_resolve():
    broken = []
    for page in _user_pages() + ["benchmarks/RESULTS.md", "benchmarks/HISTORY.md"]:
        for target in LINK.findall(_read(page)):
            path = os.path.normpath(os.path.join(os.path.dirname(page), target))
            if not os.path.exists(os.path.join(ROOT, path)) and path not in PENDING_PAGES:
                broken.append(f"{page}: {target}")
    assert not broken, broken


def test_user_pages_speak_of_the_project_only():
    """No lab-diary words in what a user reads: the pages say dates, commands, figures."""
    offenders = [
        f"{page}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for page in _user_pages()
        for text in [_read(page)]
        for m in re.finditer(r"(?i)\bsessions?\b", text)
    ]
    assert not offenders, offenders
