"""Code edit: a small function in the context; the edit instruction changes one constant;
the answer is the edited line exactly (`NAME = new`). Returning the old line is wrong."""
from __future__ import annotations

from .base import Task

_NAMES = ["LIMIT", "RETRIES", "WIDTH", "DEPTH", "OFFSET", "SCALE"]


class CodeEdit(Task):
    name = "code_edit"

    def pieces_for(self, rng):
        name = rng.choice(_NAMES)
        old = rng.randrange(2, 50)
        add = rng.randrange(2, 10)
        piece = f"\ndef f(x):\n  {name} = {old}\n  return x+{name}\n"
        q = f"\nQ: {name} += {add}; new line?\nA: "
        return ([piece], q, {"name": name, "old": old, "new": old + add},
                "\nQ: again?\nA: ")

    def reference_outputs(self, answer):
        line = f"{answer['name']} = {answer['new']}"
        return [line, line]

    def score(self, answer, outputs):
        lines = [ln.strip() for ln in outputs[-1].split("\n") if ln.strip()]
        got = " ".join(lines[0].split()) if lines else ""
        return {"success": got == f"{answer['name']} = {answer['new']}", "valid": None}
