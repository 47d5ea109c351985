"""The README's `dsv41 serve` section works as written: its command line, parsed by the
`dsv41` CLI, gives the options of a server (here in-process on a free port instead of
8000), and its `openai` snippet runs against that server."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from dsv41.cli import build_parser
from dsv41.server.cli import options_from_args

from .conftest import LiveServer

ROOT = Path(__file__).resolve().parents[2]


def _section() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    sec = text[text.index("## Serving: `dsv41 serve`"):]
    sec = sec[: sec.index("\n## ", 1)]
    command = re.search(r"```bash\n(.*?)\n```", sec, re.S).group(1).strip()
    snippet = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    return command, snippet


def test_readme_serve_command_and_openai_snippet():
    command, snippet = _section()
    assert command.startswith("dsv41 serve ") and "127.0.0.1:8000" in snippet
    args = build_parser().parse_args(command.split()[1:])
    assert args.command == "serve" and args.port == 8000
    server = LiveServer(options_from_args(args))
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(snippet.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}"), "README.md", "exec"), {})
    finally:
        server.stop()
    m = re.search(r"prompt tokens: (\d+) cached: (\d+)", out.getvalue())
    assert m and int(m.group(1)) > 0 and int(m.group(2)) == 0
    m = re.search(r"cached prompt tokens: (\d+)", out.getvalue())
    assert m and int(m.group(1)) > 64            # the second turn resumed the first (both hit)
