"""Task generators: prompt layout, evidence placement, and each scorer on hand-made right
and wrong answers."""
from __future__ import annotations

import json

import pytest

from dsv41.eval.tasks import PLACEMENTS, TASKS, TaskError
from dsv41.eval.tasks.base import first_json_object, first_number
from dsv41.eval.tokenizer import BOS, EOS, CharTokenizer

TOK = CharTokenizer(256)
W = 16


def make(task, **kw):
    args = dict(context_len=96, suffix="short", hit=48, window=W, placement="before_boundary", long_tokens=40)
    args.update(kw)
    return TASKS[task].make(TOK, 0, **args)


def test_tokenizer_round_trip_and_specials():
    s = 'pass key 123 {"a": [1, 2]}\n  x+=1;'
    ids = TOK.encode(s)
    assert TOK.decode(ids) == s and all(32 <= i < 127 or i == 10 for i in ids)
    assert TOK.decode([BOS, *ids, EOS, 200]) == s        # specials and unknown ids decode to nothing
    with pytest.raises(ValueError, match="outside the harness alphabet"):
        TOK.encode("caf\u00e9")
    with pytest.raises(ValueError, match="at least 128"):
        CharTokenizer(64)


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("suffix", ["empty", "short", "long"])
def test_layout(task, suffix):
    inst = make(task, suffix=suffix)
    assert inst.prompt[0] == BOS and inst.context_len == 96
    assert all(0 <= t < 128 for t in inst.prompt)
    text = TOK.decode(inst.prompt)
    q_len = len(TASKS[task].pieces_for(__import__("random").Random(f"{task}:0"))[1])
    if suffix == "empty":
        assert len(inst.prompt) == 96                       # the question ends the context
    elif suffix == "short":
        assert len(inst.prompt) == 96 + q_len
    else:
        assert len(inst.prompt) == 96 + len("\nTOOL OUTPUT: ") + 40 + q_len
    assert text.endswith("A: ")
    spans = sorted(inst.evidence)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))          # no overlap
    assert all(1 <= a and b <= inst.context_len for a, b in spans)       # inside the context
    assert make(task, suffix=suffix).prompt == inst.prompt                # deterministic
    assert TASKS[task].make(TOK, 1, context_len=96, suffix=suffix, hit=48, window=W,
                            placement="before_boundary", long_tokens=40).prompt != inst.prompt


def test_placement_relative_to_boundary():
    hit = 64
    b = hit - W
    for pl in PLACEMENTS:
        inst = make("passkey", context_len=128, hit=hit, placement=pl)
        a, e = inst.evidence[0]
        n = e - a
        assert TOK.decode(inst.prompt[a:e]).strip().startswith("pass key")
        expect = {"before_boundary": (b - n, b), "across_boundary": (b - n // 2, b - n // 2 + n),
                  "far_behind": (1, 1 + n), "in_window": (hit - n, hit)}[pl]
        assert (a, e) == expect, pl
        assert inst.boundary == b and inst.evidence_offset == a - b
    # a boundary too close to the start clamps to the context, and says so
    inst = make("passkey", hit=20, placement="before_boundary")
    assert inst.evidence[0][0] == 1 and inst.evidence_offset == 1 - (20 - W)


def test_does_not_fit_is_an_error():
    with pytest.raises(TaskError, match="cannot hold its evidence"):
        make("tool_loop", context_len=30)
    with pytest.raises(TaskError, match="placement"):
        make("passkey", placement="middle")
    with pytest.raises(TaskError, match="suffix"):
        make("passkey", suffix="huge")


def test_helpers():
    assert first_number("A: 0421 and 7") == "0421" and first_number("none") is None
    assert first_json_object('x {"a": {"b": "}"}} y') == ({"a": {"b": "}"}}, True)
    assert first_json_object("no braces") == (None, False)
    assert first_json_object('{"a": 1') == (None, True)
    assert first_json_object("[1] {bad json}") == (None, True)


def test_passkey_scorer():
    t = TASKS["passkey"]
    ans = make("passkey").answer
    key = ans["key"]
    assert t.score(ans, [f" {key}."])["success"]
    assert t.score(ans, [f"the key is {key}"])["success"]
    assert not t.score(ans, [f"{int(key) + 1}"])["success"]
    assert not t.score(ans, [f"{key}1"])["success"]            # a longer number is wrong
    assert not t.score(ans, [""])["success"]
    assert t.score(ans, ["12345", f"{key}"])["success"]        # multi-turn: the last turn counts
    assert t.score(ans, [key])["valid"] is None


def test_multihop_scorer():
    t = TASKS["multihop"]
    inst = make("multihop")
    a, b, c = inst.answer["chain"]
    text = TOK.decode(inst.prompt)
    assert f"{a} is {b}." in text and f"{b} is {c}." in text and f"{c} is {inst.answer['value']}." in text
    assert t.score(inst.answer, [inst.answer["value"]])["success"]
    assert not t.score(inst.answer, [c])["success"]            # stopping a hop early is wrong
    assert not t.score(inst.answer, ["1000"])["success"]


def test_extraction_scorer():
    t = TASKS["extraction"]
    ans = make("extraction").answer
    rec = ans["record"]
    good = json.dumps(rec)
    assert t.score(ans, [good]) == {"success": True, "valid": True}
    assert t.score(ans, [f'{{"name": "{rec["name"]}", "age": "{rec["age"]}", "city": "{rec["city"]}"}}'])["success"]
    wrong = json.dumps({**rec, "city": "Nowhere"})
    assert t.score(ans, [wrong]) == {"success": False, "valid": True}
    assert t.score(ans, [json.dumps({"name": rec["name"]})]) == {"success": False, "valid": True}
    assert t.score(ans, ['{"name": ']) == {"success": False, "valid": False}
    assert t.score(ans, ["name=Ada"]) == {"success": False, "valid": False}
    assert t.score(ans, ["[1, 2]"]) == {"success": False, "valid": False}


def test_code_edit_scorer():
    t = TASKS["code_edit"]
    ans = make("code_edit").answer
    name, old, new = ans["name"], ans["old"], ans["new"]
    assert t.score(ans, [f"{name} = {new}\n"])["success"]
    assert t.score(ans, [f"\n   {name}  =  {new}  \nreturn"])["success"]
    assert not t.score(ans, [f"{name} = {old}"])["success"]    # the unedited line
    assert not t.score(ans, [f"{name} = {new + 1}"])["success"]
    assert not t.score(ans, [""])["success"]


def test_tool_loop_scorer():
    t = TASKS["tool_loop"]
    inst = make("tool_loop")
    ans = inst.answer
    call = json.dumps({"tool": "lookup", "id": ans["id"]})
    assert t.score(ans, [call]) == {"success": True, "valid": True}
    assert t.score(ans, [call, f" {ans['balance']}"]) == {"success": True, "valid": True}
    assert t.score(ans, [call, "0"]) == {"success": False, "valid": True}      # wrong final answer
    assert t.score(ans, [json.dumps({"tool": "lookup", "id": "C-0"})]) == {"success": False, "valid": True}
    assert t.score(ans, [json.dumps({"tool": "search", "id": ans["id"]})]) == {"success": False, "valid": True}
    assert t.score(ans, [json.dumps({"id": ans["id"]})]) == {"success": False, "valid": False}
    assert t.score(ans, ["lookup " + ans["id"]]) == {"success": False, "valid": False}
    # the second turn carries the tool's result
    follow = TOK.decode(inst.followup)
    assert ans["id"] in follow and ans["balance"] in follow
