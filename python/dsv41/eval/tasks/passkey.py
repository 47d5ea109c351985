"""Boundary passkey: one 5-digit key in the context, asked for at the end."""
from __future__ import annotations

from .base import Task, first_number


class Passkey(Task):
    name = "passkey"

    def pieces_for(self, rng):
        key = str(rng.randrange(10000, 100000))
        return ([f" pass key {key}. "], "\nQ: pass key?\nA: ",
                {"key": key}, "\nQ: again?\nA: ")

    def reference_outputs(self, answer):
        return [answer["key"], answer["key"]]

    def score(self, answer, outputs):
        return {"success": first_number(outputs[-1]) == answer["key"], "valid": None}
