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
