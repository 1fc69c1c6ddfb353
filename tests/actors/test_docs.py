"""docs/testing.md's complete example runs as written."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def complete_example() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- complete-example[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/testing.md lost its complete example"
    return match.group(1)


def test_the_documented_example_passes():
    namespace: dict = {}
    exec(compile(complete_example(), str(DOC), "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert len(tests) == 3
    for test in tests:
        test()
