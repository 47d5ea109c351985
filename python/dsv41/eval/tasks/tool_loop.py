"""Tool-call loop: the context defines a lookup tool and holds a customer id; turn 1 must
call the tool with that id as a JSON object; the second turn (multi-turn output) returns
the tool's result and asks for a field of it.

Score: valid = every turn-1 call parses as a JSON object with a "tool" key; success =
the call names `lookup` with the right id and, when a second turn ran, its answer is the
balance the tool returned."""
from __future__ import annotations

import json

from .base import Task, first_json_object, first_number


class ToolLoop(Task):
    name = "tool_loop"
    structured = True

    def pieces_for(self, rng):
        cid = f"C-{rng.randrange(1000, 10000)}"
        balance = rng.randrange(100, 1000)
        pieces = [f" customer {cid}. ", ' tool {"tool":"lookup","id":ID} ']
        q = "\nQ: call the tool\nA: "
        follow = f'\nTOOL RESULT: {{"id": "{cid}", "balance": {balance}}}\nQ: balance?\nA: '
        return pieces, q, {"id": cid, "balance": str(balance)}, follow

    def reference_outputs(self, answer):
        return [json.dumps({"tool": "lookup", "id": answer["id"]}, separators=(",", ":")),
                answer["balance"]]

    def score(self, answer, outputs):
        call, _ = first_json_object(outputs[0])
        valid = call is not None and "tool" in call
        ok = valid and call.get("tool") == "lookup" and call.get("id") == answer["id"]
        if len(outputs) > 1:
            ok = ok and first_number(outputs[1]) == answer["balance"]
        return {"success": bool(ok), "valid": valid}
