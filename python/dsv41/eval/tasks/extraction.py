"""Structured extraction: a record in the context, returned as a JSON object with three
fields. Valid = the first {...} of the output parses as a JSON object; success = valid and
every field equal (age as an int or its digits as a string)."""
from __future__ import annotations

import json

from .base import Task, first_json_object

_FIRST = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Ken", "Frances"]
_CITY = ["Oslo", "Lima", "Kyiv", "Pune", "Perth", "Quito", "Turin", "Delft"]


class Extraction(Task):
    name = "extraction"
    structured = True

    def pieces_for(self, rng):
        rec = {"name": rng.choice(_FIRST), "age": rng.randrange(20, 90), "city": rng.choice(_CITY)}
        piece = f" name={rec['name']};age={rec['age']};city={rec['city']}. "
        return ([piece], '\nQ: as JSON?\nA: ', {"record": rec},
                "\nQ: again?\nA: ")

    def reference_outputs(self, answer):
        rec = answer["record"]
        text = json.dumps({"name": rec["name"], "age": rec["age"], "city": rec["city"]},
                          separators=(",", ":"))
        return [text, text]

    def score(self, answer, outputs):
        obj, _ = first_json_object(outputs[-1])
        valid = obj is not None
        rec = answer["record"]
        ok = valid and set(rec) <= set(obj) and obj.get("name") == rec["name"] and \
            obj.get("city") == rec["city"] and str(obj.get("age")) == str(rec["age"])
        return {"success": bool(ok), "valid": valid}
