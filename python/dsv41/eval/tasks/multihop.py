"""Multi-hop retrieval: A -> B -> C -> value; the value's piece sits at the placement, the
links elsewhere in the context."""
from __future__ import annotations

from .base import Task, first_number

_NAMES = ["K", "M", "P", "R", "T", "V", "X", "Z"]


class MultiHop(Task):
    name = "multihop"

    def pieces_for(self, rng):
        a, b, c = rng.sample(_NAMES, 3)
        a, b, c = f"{a}{rng.randrange(10)}", f"{b}{rng.randrange(10)}", f"{c}{rng.randrange(10)}"
        value = str(rng.randrange(100, 1000))
        pieces = [f" {c} is {value}. ", f" {a} is {b}. ", f" {b} is {c}. "]
        return (pieces, f"\nQ: {a}?\nA: ", {"value": value, "chain": [a, b, c]},
                f"\nQ: And {b}?\nA: ")

    def reference_outputs(self, answer):
        return [answer["value"], answer["value"]]

    def score(self, answer, outputs):
        return {"success": first_number(outputs[-1]) == answer["value"], "valid": None}
