"""One number per fact: each figure a user page quotes agrees with the results file it comes from.

A small registry: for each quoted figure, the page, a regular expression whose groups capture the numbers as the
page writes them, and a reader that takes the same numbers from their source (the default run's tables in
``docs/default_run.md``, the benchmark tables in ``benchmarks/RESULTS.md``, the study's tables in
``docs/CONVERGENCE.md``). A quoted number agrees when it is the source's value rounded to the digits the page
shows (both roundings allowed for); a count must be equal. Rerun a source and forget a page, and this fails.
"""
from __future__ import annotations

import pathlib
import re
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import pytest

from whitenlayers.experiment.report import t_interval

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_RUN = ROOT / "docs" / "default_run.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
CONVERGENCE = ROOT / "docs" / "CONVERGENCE.md"

NUMBER = r"[-+]?\d+(?:\.\d+)?"


class Value(NamedTuple):
    """A source's number and how many decimals it carries there (None: exact, e.g. computed or a count)."""

    value: float
    decimals: Optional[int] = None


def _value(cell: str, index: int = 0) -> Value:
    """The ``index``-th number of a table cell, e.g. ``'0.495 ± 0.042'`` -> 0.495 (3 decimals)."""
    text = re.findall(NUMBER, cell)[index]
    return Value(float(text), len(text.split(".")[1]) if "." in text else 0)


def _tables(path: pathlib.Path, after: Optional[str] = None) -> List[List[Dict[str, str]]]:
    """The Markdown tables of a file (below the line that starts with ``after``), as lists of rows by header."""
    lines = path.read_text().splitlines()
    if after is not None:
        lines = lines[next(i for i, ln in enumerate(lines) if ln.startswith(after)):]
    tables, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*-", lines[i + 1]):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, [c.strip() for c in lines[i].strip("|").split("|")])))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def _table(path: pathlib.Path, column: str, after: Optional[str] = None) -> List[Dict[str, str]]:
    """The first table (below ``after``) with a column named ``column``."""
    return next(t for t in _tables(path, after) if t and column in t[0])


def _cell(path: pathlib.Path, column: str, row: Dict[str, str], after: Optional[str] = None) -> str:
    """The cell in ``column`` of the first row matching every ``{column: value}`` of ``row``."""
    table = _table(path, column, after)
    return next(r for r in table if all(r.get(k) == v for k, v in row.items()))[column]


# ------------------------------------------------------------------------------------------------------------------
# The sources
# ------------------------------------------------------------------------------------------------------------------
def _summary(method: str, column: str) -> Value:
    """The default run's first summary table (``summary.md``), e.g. ``('EVD (grad)', 'kappa (last)')``."""
    return _value(_cell(DEFAULT_RUN, column, {"method": method}))


def _reached(method: str) -> List[Value]:
    """How many seeds reach the baseline's final accuracy, and of how many: ``'no estimate (2/3)'`` -> 2, 3; a
    cell without ``(k/n)`` means every seed (the default run's second table)."""
    cell = _cell(DEFAULT_RUN, "epochs to target", {"method": method})
    seeds = len({r["seed"] for r in _table(DEFAULT_RUN, "seed")})
    k = re.search(r"\((\d+)/(\d+)\)", cell)
    return [Value(float(k.group(1))), Value(float(k.group(2)))] if k else [Value(seeds), Value(seeds)]


def _epoch_lead(method: str, epoch: int) -> List[Value]:
    """Paired lead over the baseline in test accuracy at ``epoch``: mean and 95 % t-interval over the seeds, from
    the default run's per-epoch table (the runner's own interval)."""
    rows = _table(DEFAULT_RUN, "seed")
    acc = {(r["method"], r["seed"]): float(r["test acc (%)"]) for r in rows if int(r["epoch"]) == epoch}
    leads = [acc[(method, s)] - acc[("baseline", s)] for (m, s) in acc if m == "baseline"]
    return [Value(v, 2) for v in t_interval(leads)]


def _spread(column: str) -> List[Value]:
    """Baseline, then the lower and the higher of the two whitened methods (``'0.50 to 0.75-0.76'``)."""
    base = _summary("baseline", column)
    whitened = sorted([_summary("EVD (grad)", column), _summary("recursive", column)])
    return [base, *whitened]


def _results(heading: str, column: str, row: Dict[str, str], index: int = 0) -> Value:
    """A cell of the first table under ``heading`` in benchmarks/RESULTS.md."""
    return _value(_cell(RESULTS, column, row, after=heading), index)


def _gpu(variant: str, column: str = "**step vs plain**") -> Value:
    cell = _cell(RESULTS, column, {"model": "ResNet-50, 224px, batch 128, bf16, channels_last", "variant": variant},
                 after="## GPU checks and step table")
    return _value(cell.strip("*"))


OPS = "## Ops per step and host synchronisations"
STEP = "## CPU training step and memory against peers"


def _two_threads() -> List[Value]:
    """The ResNet-20 step at two threads, wall clock (the step scenario's paragraph of each layer's own step against
    the code before it): the median over its runs of grad, recursive and direct's mean / plain."""
    section = " ".join(RESULTS.read_text()[RESULTS.read_text().index(STEP):].split())
    paragraph = section[section.index("Each layer's own step against the code before it"):]
    found = re.search(rf"the median of the three runs grad ({NUMBER}), recursive ({NUMBER}), direct ({NUMBER})",
                      paragraph)
    return [_value(found.group(i)) for i in range(1, 4)]


def _memory(variant: str) -> Value:
    return _results(STEP, "peak / plain", {"variant": variant})


def _one_thread(what: str) -> List[Value]:
    """The ResNet-20 step at one thread in CPU time (the step scenario's paragraph): grad, recursive and direct's
    mean / plain (``what="ratio"``) or peak memory (``what="memory"``)."""
    section = " ".join(RESULTS.read_text()[RESULTS.read_text().index(STEP):].split())
    paragraph = section[section.index("At one thread, in process CPU time"):].split("Each layer's own step")[0]
    found = re.search(rf"grad ({NUMBER}), recursive ({NUMBER}), direct ({NUMBER}) .*peak memory ({NUMBER}) / "
                      rf"({NUMBER}) / ({NUMBER})x", paragraph)
    values = [_value(found.group(i)) for i in range(1, 7)]
    return values[:3] if what == "ratio" else values[3:]


def _gpu110(variant: str) -> Value:
    cell = _cell(RESULTS, "**step vs plain**", {"model": "CIFAR ResNet-110, batch 128, fp32", "variant": variant},
                 after="## GPU checks and step table")
    return _value(cell.strip("*"))


def _fashion_lead(method: str) -> List[Value]:
    """Paired lead over the baseline at the 1-epoch budget, Fashion-MNIST study: mean and 95 % interval."""
    cell = _cell(CONVERGENCE, "1 ep", {"method": method}, after="### Paired difference from the baseline")
    return [_value(cell, i) for i in range(3)]


PEERS = ["kfac", "foof", "shampoo", "soap", "muon"]


def _step_row(heading: str, column: str, variants: Sequence[str] = PEERS) -> List[Value]:
    """One column of a step-time table of benchmarks/RESULTS.md, for each variant in the order of the
    performance page's table."""
    return [_results(heading, column, {"variant": v}) for v in variants]


def _ratios(label: str, count: int) -> str:
    """A row of docs/performance.md's table: its label, then ``count`` ratios such as ``1.08x``."""
    return re.escape(f"| {label} |") + rf" ({NUMBER})x \|" + rf" ({NUMBER})x \|" * (count - 1)


# ------------------------------------------------------------------------------------------------------------------
# The registry: (page, what the page writes, where it comes from)
# ------------------------------------------------------------------------------------------------------------------
class Quote(NamedTuple):
    page: str
    pattern: str
    source: Callable[[], Sequence[Value]]


def _kappa_rho(page: str) -> List[Quote]:
    return [
        Quote(page, rf"`kappa`\s+({NUMBER}) to ({NUMBER})-({NUMBER})", lambda: _spread("kappa (last)")),
        Quote(page, rf"`rho`\s+({NUMBER}) to ({NUMBER})-({NUMBER})", lambda: _spread("rho (last)")),
    ]


LARGE_BATCH = ROOT / "docs" / "convergence" / "lb.md"
BEST = "its paired ratio [95 % CI]"


def _large_batch_range() -> List[Value]:
    """The smallest and largest paired ratio of the best whitened arm to the baseline over the batches (lb.md)."""
    ratios = sorted((_value(r[BEST]) for r in _table(LARGE_BATCH, BEST)), key=lambda v: v.value)
    return [ratios[0], ratios[-1]]


def _large_batch(batch: int) -> List[Value]:
    """The best whitened arm's paired ratio at ``batch`` and its interval (lb.md)."""
    cell = _cell(LARGE_BATCH, BEST, {"batch": str(batch)})
    return [_value(cell, i) for i in range(3)]


QUOTES = [
    *_kappa_rho("README.md"),
    Quote("README.md", rf"grad led the baseline by ({NUMBER}) \[({NUMBER}), ({NUMBER})\] points on a 2-core AMD EPYC "
                       rf"with 32 MiB L3 \(recursive ({NUMBER}) \[({NUMBER}), ({NUMBER})\]\)",
          lambda: _epoch_lead("grad", 2) + _epoch_lead("recursive", 2)),
    Quote("README.md", rf"at epoch 1 by ({NUMBER}) \[({NUMBER}), ({NUMBER})\] \(recursive ({NUMBER})\s+\[({NUMBER}), "
                       rf"({NUMBER})\]\)",
          lambda: _epoch_lead("grad", 1) + _epoch_lead("recursive", 1)),
    Quote("README.md",
          r"grad reached the baseline's final accuracy on (\d+) of (\d+) seeds, recursive on (\d+) of (\d+)",
          lambda: _reached("EVD (grad)") + _reached("recursive")),
    Quote("README.md", rf"1-epoch budget \(grad ({NUMBER}) \[({NUMBER}), ({NUMBER})\] points",
          lambda: _fashion_lead("EVD (grad)")),
    # the README's one cost table, a row per measurement, and the memory under it
    Quote("README.md", _ratios("CPU, CIFAR ResNet-20, 1 thread, CPU time", 3), lambda: _one_thread("ratio")),
    Quote("README.md", _ratios("CPU, CIFAR ResNet-20, 2 threads, wall clock", 3), _two_threads),
    Quote("README.md", _ratios("GPU, ResNet-50, 224 px, bf16", 3),
          lambda: [_gpu(v) for v in ("grad", "recursive", "direct")]),
    Quote("README.md", _ratios("GPU, CIFAR ResNet-110, fp32", 3),
          lambda: [_gpu110(v) for v in ("grad", "recursive", "direct")]),
    Quote("README.md", rf"direct ({NUMBER})x in the first row's run, ({NUMBER})x in the third's",
          lambda: [_one_thread("memory")[2], _gpu("direct", "peak memory vs plain")]),
    Quote("README.md", rf"the best whitened arm needs ({NUMBER})-({NUMBER})x the baseline's steps to a target",
          _large_batch_range),
    Quote("docs/training.md", rf"the best whitened arm needed ({NUMBER})-({NUMBER})x the baseline's steps",
          _large_batch_range),
    Quote("docs/CONVERGENCE.md", rf"needs ({NUMBER})x to ({NUMBER})x the baseline's steps to 80 % validation",
          _large_batch_range),
    Quote("docs/CONVERGENCE.md", rf"at batch 512 ({NUMBER})x \[({NUMBER}), ({NUMBER})\], the one interval below 1",
          lambda: _large_batch(512)),
    *_kappa_rho("docs/default_run.md"),
    *[Quote("docs/default_run.md", rf"at epoch {epoch} by ({NUMBER}) \[({NUMBER}), ({NUMBER})\] \(grad\) and "
                                   rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\] \(recursive\)",
            lambda epoch=epoch: _epoch_lead("grad", epoch) + _epoch_lead("recursive", epoch)) for epoch in (1, 2)],
    Quote("docs/default_run.md", r"grad on (\d+) of (\d+)\s+seeds, recursive on (\d+) of (\d+)",
          lambda: _reached("EVD (grad)") + _reached("recursive")),
    Quote("docs/default_run.md", rf"An epoch costs ({NUMBER})x \(grad\) and ({NUMBER})x \(recursive\)",
          lambda: [_summary("EVD (grad)", "time vs baseline"), _summary("recursive", "time vs baseline")]),
    Quote("docs/performance.md", _ratios("step vs plain", 8),
          lambda: [*_two_threads(), *_step_row(STEP, "mean / plain")]),
    Quote("docs/performance.md", _ratios("peak memory vs plain", 8),
          lambda: _step_row(STEP, "peak / plain", ["grad", "recursive", "direct", *PEERS])),
    Quote("docs/performance.md", _ratios("step vs plain, defaults", 5),
          lambda: [_gpu(v) for v in ("grad", "recursive", "direct", "muon", "soap")]),
    Quote("docs/performance.md",
          rf"\| step vs plain, `stats_every=5, block_size=50` \| ({NUMBER})x \| \*\*({NUMBER})x\*\*",
          lambda: [_gpu("grad:every5,block50"), _gpu("recursive:every5,block50")]),
]


def _agrees(quoted: str, source: Value) -> bool:
    if source.decimals is None and "." not in quoted:  # a count
        return int(quoted) == source.value
    shown = len(quoted.split(".")[1]) if "." in quoted else 0
    tolerance = 0.5 * 10.0 ** -shown + (0.5 * 10.0 ** -source.decimals if source.decimals is not None else 0.0)
    # the two roundings' intervals overlap (touching at one end is a different last digit: 1.004 against 1.003)
    return abs(float(quoted) - source.value) < tolerance * (1 - 1e-9)


@pytest.mark.parametrize("quote", QUOTES, ids=lambda q: f"{q.page}:{q.pattern[:40]}")
def test_page_figures_agree_with_their_source(quote):
    text = " ".join((ROOT / quote.page).read_text().split())  # line breaks as spaces
    found = re.search(quote.pattern, text)
    assert found, f"{quote.page} no longer quotes /{quote.pattern}/: update the registry with the page"
    source = list(quote.source())
    quoted = found.groups()
    assert len(quoted) == len(source)
    wrong = [(q, s.value) for q, s in zip(quoted, source) if not _agrees(q, s)]
    assert not wrong, f"{quote.page} quotes {found.group(0)!r}; its source holds {[s.value for s in source]}"


def test_the_check_catches_a_figure_its_source_does_not_hold():
    assert _agrees("1.24", Value(1.238, 3)) and _agrees("0.50", Value(0.495, 3)) and _agrees("2", Value(2.0))
    assert not _agrees("1.25", Value(1.238, 3)) and not _agrees("0.52", Value(0.495, 3))
    assert not _agrees("3", Value(2.0)) and not _agrees("1.004", Value(1.003, 3))
