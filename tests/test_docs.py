"""docs/PAPER.md stays traceable: citations resolve inside the repository, and named code exists."""
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAPER = ROOT / "docs" / "PAPER.md"
#: The Markdown pages a reader follows links in: the README and the documentation site's pages.
PAGES = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
SOURCES = sorted(
    [*ROOT.glob("whitenlayers/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"), *PAGES]
)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_cited_errata_item_has_a_section():
    sections = {int(n) for n in re.findall(r"^### ERRATA (\d+):", PAPER.read_text(), flags=re.M)}
    assert sections == set(range(1, 9))
    for path in SOURCES:
        if path.name == "test_docs.py":
            continue
        for n in re.findall(r"ERRATA (?:items? )?(\d+)", path.read_text()):
            assert int(n) in sections, (path.name, n)


def test_no_citation_of_files_outside_the_repository():
    for path in SOURCES:
        if path.name == "test_docs.py":
            continue
        text = path.read_text()
        for bad in ("ERRATA.md", "SPEC", "paper/"):
            assert bad not in text, (path.relative_to(ROOT), bad)


@pytest.mark.parametrize("doc", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = doc.read_text()
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), (doc.name, link)
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path.read_text()), (doc.name, link)


def test_every_equation_of_the_paper_has_a_row():
    rows = re.findall(r"^\| \((\d+)\) \|", PAPER.read_text(), flags=re.M)
    assert sorted(map(int, rows)) == list(range(1, 52))


def test_function_index_names_existing_code():
    text = PAPER.read_text()
    index = text[text.index("## Function index"):]
    rows = re.findall(r"^\| (`.*?) \| \[`([\w/]+)\.py`\]", index, flags=re.M)
    assert len(rows) >= 20
    for names, module in rows:
        mod = importlib.import_module("whitenlayers." + module.replace("/__init__", "").replace("/", "."))
        for name in re.findall(r"`(\w+)`", names):
            assert hasattr(mod, name), (module, name)


def test_api_page_documents_every_public_name():
    """docs/api.md (the site's API reference) has an autodoc entry for every name of ``whitenlayers.__all__``."""
    import whitenlayers as wl

    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:class|function|module):: (?:whitenlayers\.)?(\w+)", text, flags=re.M))
    assert set(wl.__all__) <= documented, sorted(set(wl.__all__) - documented)


def test_every_page_is_in_the_site():
    """Every docs/*.md page is in a toctree of the site (Sphinx -W fails on orphans; this says which page)."""
    text = "\n".join(p.read_text() for p in PAGES)
    trees = re.findall(r"```\{toctree\}\n(.*?)```", text, flags=re.S)
    listed = {ln.strip() for tree in trees for ln in tree.splitlines() if ln.strip() and not ln.startswith(":")}
    for page in PAGES[1:]:
        if page.stem not in ("index", "coverage_notes"):  # the root; a fragment pasted into COVERAGE.md
            assert page.stem in listed, page.name


#: A path a page names in prose or code (``docs/x.md``, ``benchmarks/y.py``), not as a Markdown link.
CITED_PATH = re.compile(r"(?<![\w/.-])((?:docs|benchmarks|whitenlayers|tests|\.ci)/[\w./-]*\w)")


@pytest.mark.parametrize("doc", [*PAGES, ROOT / "benchmarks" / "RESULTS.md"], ids=lambda p: p.name)
def test_every_cited_file_exists(doc):
    """A file a page names (``docs/convergence/x.md``, ``benchmarks/gpu.py``) is in the repository, as a Markdown
    link's target must be; the site's build output (``docs/_build``) is made by the command that names it."""
    missing = [p for p in CITED_PATH.findall(doc.read_text())
               if not p.startswith("docs/_build") and not (ROOT / p).exists()]
    assert not missing, (doc.name, missing)


#: The pages that record studies and measurements, with the issues and commits they were made at; every other
#: page is for users and says what to do, not when it changed (COVERAGE.md and its notes are generated records,
#: each row naming the commit it was measured at).
RECORDS = {"CONVERGENCE.md", "COVERAGE.md", "coverage_notes.md", "changelog.md", "default_run.md"}
#: An issue number ("issue 22", an anchor "#...-issue-25") or a commit: "commit 8316328", or 7 to 40 hex digits
#: with a letter and a digit standing alone ("4b17493").
HISTORY = re.compile(r"\b[Ii]ssues? \d+|#[\w-]*issue-\d+|\bcommits?\s+`?[0-9a-f]{7,40}\b"
                     r"|(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w.-])")


def _without_the_cost_table(text: str) -> str:
    """The README but its cost table ("## What it costs"), whose rows each name the commit measured."""
    if "## What it costs" not in text:
        return text
    head, section = text.split("## What it costs", 1)
    section, rest = section.split("\n## ", 1) if "\n## " in section else (section, None)
    kept = "".join(ln for ln in section.splitlines(keepends=True) if not ln.startswith("|"))
    return head + kept + ("" if rest is None else "\n## " + rest)


@pytest.mark.parametrize("doc", [p for p in PAGES if p.name not in RECORDS], ids=lambda p: p.name)
def test_user_pages_name_no_issue_or_commit(doc):
    text = doc.read_text()
    hits = HISTORY.findall(_without_the_cost_table(text) if doc.name == "README.md" else text)
    assert not hits, (doc.name, hits)


#: Mentions of the project's own history: an issue number, a work session, a branch. The pages are for users; what
#: changed when is git's and CHANGELOG.md's (commits may stay where a table names the code it measured).
HISTORY_WORDS = re.compile(r"\b(?:[Ii]ssues?\s+#?\d+|[Ss]essions?\b|this branch\b|[Bb]ranch(?:es)?\s+(?:`[^`]+`|main\b|"
                           r"i\d+\b|issue\w*))|(?<![\w&])#\d+\b"
                           # "the hot-path issue", "the issue allows", "those machines", "the last round"
                           r"|\b[Tt]he\s+(?:[\w-]+\s+){0,2}issue\b|\bthose machines\b|\b(?:last|this|previous) round\b")
#: Every page a user reads: the README, the site's pages and the fragments they include, the benchmark results.
USER_PAGES = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("docs/convergence/*.md")),
              ROOT / "benchmarks" / "RESULTS.md"]


@pytest.mark.parametrize("doc", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_name_no_issue_session_or_branch(doc):
    hits = [m.group(0) for m in HISTORY_WORDS.finditer(doc.read_text())]
    assert not hits, (doc.name, hits)


def test_the_history_check_catches_what_it_names():
    for text in ("issue 11 asks", "Issues 12-16", "in this session", "branch `x`", "(pre-#12)", "see #25",
                 "on this branch", "branch i47 at", "since the hot-path issue", "the two hours the issue allows",
                 "the CPU wheel those machines carry", "measured in the last round"):
        assert HISTORY_WORDS.search(text), text
    for text in ("a tissue 3", "the sessionless API", "branching factor", "`block_size`", "the branch did not run",
                 "calls to modules that issue collectives", "a round of folds"):
        assert not HISTORY_WORDS.search(text), text


#: Names outside the package that the design pages write with dots (``torch.linalg.eigh``, ``x.flatten``).
FOREIGN = {"torch", "np", "numpy", "nn", "F", "dist", "math", "os", "sys", "einops", "pytest", "timm", "torchvision",
           "transformers", "lightning", "hypothesis", "functools", "copy", "pickle", "safetensors", "onnx"}
FILE_SUFFIXES = {"py", "md", "json", "csv", "png", "pt", "txt", "cfg", "toml", "sh"}


def _defined_names() -> set:
    """Every name the package and the benchmark suite define: functions, classes, assignments, annotated fields
    (a NamedTuple's, a dataclass's), attributes set on ``self``, and string keys (buffer names)."""
    src = "\n".join(p.read_text() for p in [*ROOT.glob("whitenlayers/**/*.py"), *ROOT.glob("benchmarks/*.py")])
    return (set(re.findall(r"(?:def|class)\s+(\w+)", src))
            | set(re.findall(r"^\s*(\w+)\s*(?::[^=\n]*)?=", src, flags=re.M))
            | set(re.findall(r"^\s+(\w+)\s*:\s*[\w\[\]., \"']+(?:#.*)?$", src, flags=re.M))
            | set(re.findall(r"\bself\.(\w+)\s*=", src)) | set(re.findall(r"[\"'](\w+)[\"']", src)))


def _named_code(text: str):
    """The code a page names in backticks: dotted names (``WhiteningLayer.fold_writes``, ``fold._outcomes``) and
    private names (``_zca_from_eig``), with the parts that must exist: every private part and the last one."""
    for span in re.findall(r"`([^`\n]+)`", text):
        span = re.sub(r"\(.*\)$", "", span.strip())
        if not re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|_\w+", span):
            continue
        parts = span.split(".")
        if parts[0] in FOREIGN or parts[-1] in FILE_SUFFIXES or re.fullmatch(r"[a-z]", parts[0]):
            continue  # another library, a file name, a local variable (``x.flatten``)
        yield span, [p for i, p in enumerate(parts) if p.startswith("_") or i == len(parts) - 1]


@pytest.mark.parametrize("page", ["PAPER.md", "development.md"])
def test_design_pages_name_only_code_that_exists(page):
    """docs/PAPER.md and docs/development.md name private helpers and attributes: each must be defined in the
    package (a renamed helper fails here, not in a reader's search)."""
    defined = _defined_names()
    named = list(_named_code((ROOT / "docs" / page).read_text()))
    assert named
    missing = sorted({span for span, parts in named if any(p not in defined for p in parts)})
    assert not missing, (page, missing)


def test_the_code_check_catches_a_name_that_does_not_exist():
    defined = _defined_names()
    named = dict(_named_code("`_fold_start` and `WhiteningLayer.fold_writes` and `torch.linalg.eigh` and `x.view`"))
    assert set(named) == {"_fold_start", "WhiteningLayer.fold_writes"}
    assert "_fold_start" not in defined and "fold_writes" in defined


def test_user_pages_stay_short():
    """The README is a front page (<= 157 lines: its opening says what the package is for, what it costs and what it
    has shown; 155 until the cost table's caveat that its GPU rows predate each layer's own step) and the benchmark results hold current tables only (<= 520: 500 until the table of an exit with a
    fold in flight, ``benchmarks/fold_exit.py``, a measurement of its own)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 157
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 520
