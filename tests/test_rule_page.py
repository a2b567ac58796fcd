"""Issue 75: docs/writing-a-rule.md shows its example rule whole (a repository's viewer shows no Sphinx include), the
same text as the tested file, tests/rule_example.py (which tests/test_rules.py trains with)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_rule_page_shows_the_tested_example_whole():
    page = (ROOT / "docs" / "writing-a-rule.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    example = (ROOT / "tests" / "rule_example.py").read_text()
    assert example in blocks, "docs/writing-a-rule.md: paste tests/rule_example.py whole into its example block"
    assert "literalinclude" not in page
