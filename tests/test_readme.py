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
