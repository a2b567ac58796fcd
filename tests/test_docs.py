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
RECORDS = {"CONVERGENCE.md", "COVERAGE.md", "coverage_notes.md", "changelog.md"}
#: An issue number ("issue 22", an anchor "#...-issue-25") or a commit: "commit 8316328", or 7 to 40 hex digits
#: with a letter and a digit standing alone ("4b17493").
HISTORY = re.compile(r"\b[Ii]ssues? \d+|#[\w-]*issue-\d+|\bcommits?\s+`?[0-9a-f]{7,40}\b"
                     r"|(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w.-])")


@pytest.mark.parametrize("doc", [p for p in PAGES if p.name not in RECORDS], ids=lambda p: p.name)
def test_user_pages_name_no_issue_or_commit(doc):
    hits = HISTORY.findall(doc.read_text())
    assert not hits, (doc.name, hits)
