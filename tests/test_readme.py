"""The README's Python examples run as written."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    # The comments in the example state what it prints: check them.
    for line, out in zip(
        [ln for ln in BLOCKS[index].splitlines() if ln.startswith("print(")], printed.strip().splitlines()
    ):
        expected = re.search(r"#\s*(\d+)\s", line + " ")
        if expected:
            assert out.split()[0] == expected.group(1), (line, out)


BASH = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_main_job_and_the_ci_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    assert BASH[0].strip().endswith("python -m whitenlayers.experiment")  # the runner's default invocation
    assert BASH[1].strip() in ci  # CI runs the README's test command verbatim
    # ... which leaves the slow tests out (setup.cfg), and then the README's command for them
    assert '-m "not slow"' in (README.parent / "setup.cfg").read_text()
    slow = re.search(r"`(python -m pytest [^`]*-m slow)`", README.read_text())
    assert slow and slow.group(1) in ci.split(BASH[1].strip(), 1)[1]


def test_readme_runner_commands_parse():
    """Every ``python -m whitenlayers.experiment ...`` line in the README and the runner's page names existing
    options."""
    import importlib.util
    import shlex

    from whitenlayers import experiment as ex

    text = "\n".join(p.read_text() for p in (README, README.parent / "docs" / "runner.md")).replace("\\\n", " ")
    lines = [ln.split("#")[0] for ln in text.splitlines() if "-m whitenlayers.experiment" in ln and "`" not in ln]
    assert len(lines) >= 5
    # methods whose optional package (the 'peers' extra) is absent here: their lines parse but cannot validate
    absent = {name for name, m in ex.METHOD_REGISTRY.items() if m.requires and importlib.util.find_spec(m.requires) is None}
    for line in lines:
        argv = shlex.split(line.split("-m whitenlayers.experiment", 1)[1])
        args = ex.build_parser().parse_args(argv)  # SystemExit on an unknown option
        # paper-imagenet checks the folder exists only when it runs
        if "imagefolder:" not in line and not absent & set(re.split(r"[\s,=]+", line)):
            ex.resolve_config(args)


# --------------------------------------------------------------------------
# What it costs: one table (issue 80)
# --------------------------------------------------------------------------
RESULTS = README.parent / "benchmarks" / "RESULTS.md"
RATIO = r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b"  # 1.07x, 1.68-2.51x
#: Each row of the cost table: the section of benchmarks/RESULTS.md that records it, the text there that names its
#: commit (``{commit}``: the row's) and the machine there, which the row's machine cell must name.
COST_ROWS = {
    "CPU, CIFAR ResNet-20, 1 thread, CPU time":
        ("## CPU training step and memory against peers", r"--threads 1 --clock cpu`, commit {commit}, ", "AMD EPYC"),
    "CPU, CIFAR ResNet-20, 2 threads, wall clock":
        ("## CPU training step and memory against peers", r"--rounds 40 --skip-accuracy`, {commit} alternated",
         "AMD EPYC"),
    "GPU, ResNet-50, 224 px, bf16": ("## GPU checks and step table", r"\| commit \| {commit} ", "H100"),
    "GPU, CIFAR ResNet-110, fp32": ("## GPU checks and step table", r"\| commit \| {commit} ", "H100"),
}


def _prose(text: str) -> str:
    """The page without its code blocks."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _tables(text: str) -> list:
    """Each Markdown table of the page as its list of rows (lists of stripped cells), header first."""
    tables, current = [], []
    for line in _prose(text).splitlines() + [""]:
        if line.startswith("|"):
            if not re.match(r"^\|\s*-", line):
                current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables, current = tables + [current], []
    return tables


def _section(text: str, heading: str) -> str:
    return text[text.index(heading):].split("\n## ", 1)[0]


def test_readme_answers_what_it_costs_in_one_table():
    text = README.read_text()
    costs = [t for t in _tables(text) if any(re.fullmatch(RATIO, c) for row in t[1:] for c in row)]
    assert len(costs) == 1, costs  # one table of step ratios, not one per section
    header, *rows = costs[0]
    assert header[-2:] == ["machine", "commit"] and header[1:4] == ["grad", "recursive", "direct"]
    assert _tables(_section(text, "## What it costs")) == costs
    assert [r[0] for r in rows] == list(COST_ROWS)
    results = " ".join(RESULTS.read_text().split())
    for label, *ratios, machine, commit in rows:
        assert all(re.fullmatch(RATIO, r) for r in ratios), (label, ratios)
        heading, names, source_machine = COST_ROWS[label]
        if commit == "commit not recorded":
            continue
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), (label, commit)
        source = results[results.index(heading):].split(" ## ", 1)[0]  # (line breaks as spaces)
        assert re.search(names.format(commit=commit), source), f"{label}: {heading} names no commit {commit}"
        assert source_machine in machine and source_machine in source, (label, machine)


def test_readme_quotes_no_other_step_or_epoch_cost():
    """Outside the cost table's section no sentence gives a ratio of a step's or an epoch's cost (x a plain step, an
    epoch's x the baseline's): the page points to the table instead."""
    text = _prose(README.read_text())
    text = text.replace(_section(text, "## What it costs"), "")
    sentences = re.split(r"(?<=[.;:])\s+|\n\n|\n- ", " ".join(text.split("\n")).replace("  ", " "))
    quoted = [s for s in sentences if re.search(RATIO, s) and re.search(r"\b(?:plain|epochs?|step|CPU|GPU)\b", s)]
    assert not quoted, quoted
    assert "(#what-it-costs)" in text.split("```", 1)[0]  # the opening points to the table


def test_readme_says_the_torch_floor_setup_cfg_declares():
    floor = re.search(r"torch>=(\d+\.\d+)", (README.parent / "setup.cfg").read_text()).group(1)
    setup = README.read_text().split("```bash", 1)[0].strip().rsplit("\n\n", 1)[1]  # the paragraph before them
    assert f"needs torch {floor} or newer" in setup and f"`torch>={floor}`" in README.read_text()
    assert "(" not in setup  # plain short sentences
    assert max(len(s.split()) for s in re.split(r"(?<=\.)\s+", setup)) <= 25


def test_runner_md_gives_every_size_in_kb_or_mib():
    """docs/runner.md's sizes are in kB (1,000 bytes) or MiB (2^20 bytes), both defined; none in MB, KB or GB."""
    text = (README.parent / "docs" / "runner.md").read_text()
    assert "kB: 1,000 bytes; MiB:\n2^20 bytes" in text
    sizes = re.findall(r"\b\d+(?:\.\d+)? ?([KMGkTm]i?B)\b", text)
    assert sizes and set(sizes) <= {"kB", "MiB"}, sizes
    # the figure's size is the default run's figure's (docs/default_run.png), in MiB
    figure = re.search(r"About ([\d.]+) MiB", text[text.index("`figure.png`"):])
    assert figure and float(figure.group(1)) == round((README.parent / "docs" / "default_run.png").stat().st_size
                                                      / 2**20, 1)
