"""Every `dsv41` command against hostile arguments and input files (issue 29, item 4).

The subcommands and their options are discovered from the argparse tree, so a command or
option added later is covered: each command gets an unknown option and a missing value; an option with choices a value outside them; a numeric option (which must
declare its range with dsv41.argcheck's IntRange / FloatRange) values just outside its
range, and one numeric option of each command text, NaN and infinity; an option or positional that names a file or directory (by
its metavar) a missing path, a directory or a file where the other is wanted, /dev/zero,
a FIFO, a directory that cannot be searched (unprivileged) and, for config files, hostile
JSON. A hand table adds the cases the issue names.

Each case runs in a child process with a deadline (forked from one process that imported
dsv41 once: tests/cli_zygote.py), two at a time. Every one must end by itself with exit
status 1 or 2, no traceback, and a last stderr line that is a one-line `dsv41 ...` message.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsv41.argcheck import FloatRange, IntRange
from dsv41.cli import build_parser

ZYGOTE = Path(__file__).with_name("cli_zygote.py")
DEADLINE_S = 30.0          # a case that runs longer hung (each takes well under a second alone)
# what every case of a command starts with, before the option under test (a later
# occurrence wins): were a case to start a server, it would not take a fixed port
BASE_ARGS = {("serve",): ["--port", "0"]}
# what the commands import when they run, imported once before the children fork
PRELOAD = ["dsv41.model", "dsv41.engine", "dsv41.cache", "dsv41.eval", "dsv41.gpu_plan", "dsv41.server.app",
           "dsv41.model.checkpoint", "uvicorn"]
# metavars that name something on disk, and what it must be
FILE_METAVARS = {"PATH": "config", "MATRIX.yaml": "yaml", "CONTRACT.yaml": "yaml", "FILE": "text"}
DIR_METAVARS = {"DIR", "CKPT_DIR", "DIR|NAME", "dir"}
OUTPUT_DIRS = {"out", "cache_dir"}   # may be missing (they are created); never a file or device
# options a hostile value cannot reach without starting a long run (they take any string and
# only mean something to the server or model once it runs): covered by the hand table
FREE_TEXT = {"--host", "--served-model-name", "--log-level", "--device", "--remote-blocks", "--remote-snapshots"}


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every runnable subcommand."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaves(sub, path + (name,))


def valid_positionals(parser: argparse.ArgumentParser, ok_dir: str) -> list[str]:
    return [ok_dir for a in parser._actions if not a.option_strings and a.nargs is None
            and not isinstance(a, argparse._SubParsersAction)]


class Fixtures:
    """The hostile files and directories, in a directory every user can search."""

    def __init__(self, root: Path):
        self.root = root
        root.chmod(0o755)
        self.missing = str(root / "missing")
        self.empty_dir = str(root / "empty-dir")
        os.mkdir(self.empty_dir)
        self.fifo = str(root / "fifo")
        os.mkfifo(self.fifo)
        self.garbage = self.write("garbage.bin", b"\x00\xff\xfe not json, not yaml: [\n")
        self.locked = str(root / "locked" / "inner")
        os.makedirs(self.locked)
        os.chmod(root / "locked", 0)
        good = self.good_config()
        self.configs = {
            "list": self.write("list.json", b"[1, 2, 3]"),
            "null": self.write("null.json", b"null"),
            "empty": self.write("empty.json", b""),
            "not-utf8": self.write("not-utf8.json", b'{"name": "\xff\xfe"}'),
            "deep-array": self.write("deep-array.json", b"[" * 100_000 + b"]" * 100_000),
            "deep-object": self.write("deep-object.json", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
            "nan": self.write("nan.json", json.dumps({**good, "rope_theta": float("nan")}).encode()),
            "huge-int": self.write("huge-int.json", json.dumps(self.with_fields(good, vocab_size=2**63)).encode()),
            "digits": self.write("digits.json", b'{"vocab_size": 1' + b"0" * 5000 + b"}"),
            "negative-vocab": self.write("neg.json", json.dumps(self.with_fields(good, vocab_size=-1)).encode()),
            "string-layers": self.write("str-layers.json", json.dumps(self.with_fields(good, num_hidden_layers="8"))
                                        .encode()),
            "ratios-not-list": self.write("ratios.json", json.dumps(self.with_fields(good, compress_ratios=3))
                                          .encode()),
            "text-config-list": self.write("tc-list.json", json.dumps({"text_config": [1]}).encode()),
            "big-file": self.write("big.json", b'{"pad": "' + b"x" * (5 << 20) + b'"}'),
        }
        # valid model configs that only `plan` (stored formats, weights counted) must refuse
        self.plan_configs = {
            "quant-string": self.write("quant-str.json", json.dumps({**good, "quantization_config": "fp8"})
                                       .encode()),
            "quant-block-0": self.write("quant-0.json", json.dumps(
                {**good, "quantization_config": {"weight_block_size": [0, 0]}}).encode()),
            "quant-dtype": self.write("quant-dt.json", json.dumps(
                {**good, "quantization_config": {"expert_dtype": ["fp4"]}}).encode()),
            "experts-2^40": self.write("experts.json", json.dumps(self.with_fields(good, n_routed_experts=2**40))
                                       .encode()),
        }
        self.yamls = {"empty": self.write("empty.yaml", b""), "list": self.write("list.yaml", b"- 1\n- 2\n"),
                      "deep": self.write("deep.yaml", b"[" * 5_000 + b"]" * 5_000),
                      "bomb": self.write("bomb.yaml", b"a: &a [x, x, x, x, x, x, x, x, x]\n"
                                         + b"".join(b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n"
                                                    % ((98 + i,) * 2 + (97 + i,) * 9) for i in range(12)))}
        # checkpoint directories whose config.json is hostile
        self.ckpts = {}
        for name, src in (("fifo", self.fifo), ("deep", self.configs["deep-array"]),
                          ("list", self.configs["list"]), ("garbage", self.garbage)):
            d = root / f"ckpt-{name}"
            d.mkdir()
            target = d / "config.json"
            if name == "fifo":
                os.mkfifo(target)
            else:
                shutil.copyfile(src, target)
            self.ckpts[name] = str(d)
        zero = root / "ckpt-zero"
        zero.mkdir()
        (zero / "config.json").symlink_to("/dev/zero")
        self.ckpts["dev-zero"] = str(zero)
        # a valid model config whose weight index is a FIFO (read whole: it must be refused,
        # not read)
        d = root / "ckpt-index-fifo"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(good))
        (d / "config.json").chmod(0o644)
        os.mkfifo(d / "model.safetensors.index.json")
        self.ckpts["index-fifo"] = str(d)
        # a valid model config whose "dsv41" key (save_pretrained's model options) is no object
        d = root / "ckpt-dsv41-array"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**good, "dsv41": [1]}))
        (d / "config.json").chmod(0o644)
        self.ckpts["dsv41-array"] = str(d)

    @staticmethod
    def good_config() -> dict:
        from dsv41.config import ModelConfig
        return ModelConfig.preset("v41-tiny").to_hf_dict()

    @staticmethod
    def with_fields(good: dict, **changes) -> dict:
        out = json.loads(json.dumps(good))
        out.update(changes)
        return out

    def write(self, name: str, data: bytes) -> str:
        p = self.root / name
        p.write_bytes(data)
        p.chmod(0o644)
        return str(p)

    def paths(self, kind: str) -> list[tuple[str, str, int | None]]:
        """(label, path, unprivileged) hostile for something of `kind` (config, yaml, dir, out)."""
        out = [("fifo", self.fifo, False), ("/dev/zero", "/dev/zero", False), ("unsearchable", self.locked, True)]
        if kind == "out":
            return out + [("a file", self.garbage, False), ("under a file", self.garbage + "/sub", False)]
        out.append(("missing", self.missing, False))
        if kind == "dir":
            out += [("a file", self.garbage, False)] + [(f"checkpoint {k}", v, False) for k, v in self.ckpts.items()]
        else:
            out += [("a directory", self.empty_dir, False), ("garbage", self.garbage, False)]
        if kind == "config":
            out += [(f"config {k}", v, False) for k, v in self.configs.items()]
        if kind == "yaml":
            out += [(f"yaml {k}", v, False) for k, v in self.yamls.items()]
        if kind == "text":   # any file read whole: bounded like a config
            out.append(("big file", self.configs["big-file"], False))
        return out


def out_of_range(t) -> list[str]:
    """Just below and just above a numeric option's range."""
    if isinstance(t, IntRange):
        return [str(t.lo - 1), str(t.hi + 1 if t.hi is not None else 10**40)]
    return [repr(t.lo) if t.lo_open else repr(t.lo - 1), repr(t.hi * 2)]


NOT_NUMBERS = ["abc", "nan", "inf"]   # one option of each command gets these (same type code everywhere)


def discovered_cases(fx: Fixtures, unranged: list[str]) -> list[tuple[str, list[str], bool, str | None]]:
    cases = []
    for words, p in leaves(build_parser()):
        cmd = list(words) + BASE_ARGS.get(words, [])
        name = " ".join(words)
        pos = valid_positionals(p, fx.empty_dir)

        def add(label: str, argv: list[str], unprivileged: bool = False) -> None:
            cases.append((f"{name} {label}", cmd + argv, unprivileged, None))
        add("unknown option", pos + ["--no-such-option"])
        first_value = first_number = True
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not a.option_strings:   # a positional: a file or directory
                if a.metavar in DIR_METAVARS or a.dest in ("dir", "directory"):
                    for label, path, unpriv in fx.paths("dir"):
                        add(f"{a.dest}={label}", [path], unpriv)
                continue
            opt = a.option_strings[-1]
            if a.nargs == 0:   # flags
                continue
            if first_value:
                add(f"{opt} without a value", pos + [opt])
                first_value = False
            if a.choices is not None:
                add(f"{opt} bad choice", pos + [opt, "no-such-choice"])
            elif isinstance(a.type, (IntRange, FloatRange)):
                values = out_of_range(a.type) + (NOT_NUMBERS if first_number else [])
                first_number = False
                for v in values:
                    add(f"{opt}={v!r}", pos + [f"{opt}={v}"])
            elif a.type in (int, float):
                unranged.append(f"{name} {opt}")
            elif a.metavar in FILE_METAVARS:
                for label, path, unpriv in fx.paths(FILE_METAVARS[a.metavar]):
                    add(f"{opt}={label}", pos + [opt, path], unpriv)
            elif a.dest in OUTPUT_DIRS:
                for label, path, unpriv in fx.paths("out"):
                    add(f"{opt}={label}", pos + [opt, path], unpriv)
            elif a.metavar in DIR_METAVARS:
                for label, path, unpriv in fx.paths("dir"):
                    add(f"{opt}={label}", pos + [opt, path], unpriv)
    return cases


def hand_cases(fx: Fixtures, store: str) -> list[tuple[str, list[str], bool, str | None]]:
    """The failures issue 29 names, with what their message must say, and free-text
    options with values no run may start on."""
    c = fx.configs
    named = [
        ("kv-bytes --config top-level list", ["kv-bytes", "--config", c["list"]], "top level"),
        ("kv-bytes --config null", ["kv-bytes", "--config", c["null"]], "top level"),
        ("kv-bytes --config 100,000 deep", ["kv-bytes", "--config", c["deep-array"]], "nested deeper"),
        ("kv-bytes --config vocab 2^63", ["kv-bytes", "--config", c["huge-int"]], "out of range"),
        ("kv-bytes --config /dev/zero", ["kv-bytes", "--config", "/dev/zero"], "not a regular file"),
        ("kv-bytes --config FIFO", ["kv-bytes", "--config", fx.fifo], "not a regular file"),
        ("plan --config string quantization_config", ["plan", "--config", fx.plan_configs["quant-string"]],
         "quantization_config"),
        ("plan --config vocab 2^63", ["plan", "--config", c["huge-int"]], "out of range"),
        ("plan --gpu-memory-gb inf", ["plan", "--gpu-memory-gb", "inf"], "--gpu-memory-gb"),
        ("plan --config FIFO", ["plan", "--config", fx.fifo], "not a regular file"),
        ("demo --preset bogus", ["demo", "--preset", "bogus"], "--preset"),
        ("demo --model missing", ["demo", "--model", fx.missing], "missing"),
        ("demo --model \"dsv41\": [1]", ["demo", "--model", fx.ckpts["dsv41-array"]], '"dsv41" key'),
        ("demo --model index FIFO", ["demo", "--model", fx.ckpts["index-fifo"]], "not a regular file"),
        ("demo --block-tokens 0", ["demo", "--block-tokens", "0"], "--block-tokens"),
        ("demo --block-tokens 7", ["demo", "--block-tokens", "7"], "block"),
        ("serve --port -1", ["serve", "--port", "-1"], "--port"),
        ("serve --api-key-file FIFO", ["serve", "--port", "0", "--api-key-file", fx.fifo], "not a regular file"),
        ("serve --api-key-file /dev/zero", ["serve", "--port", "0", "--api-key-file", "/dev/zero"],
         "not a regular file"),
        ("serve --api-key-file binary", ["serve", "--port", "0", "--api-key-file", fx.garbage], "not UTF-8"),
        ("cache gc --capacity 1e-9G", ["cache", "gc", store, "--capacity", "1e-9G"], "less than one record"),
        ("cache gc --capacity 100", ["cache", "gc", store, "--capacity", "100"], "less than one record"),
    ]
    unsearchable = [(f"cache {cmd} unsearchable store", ["cache", cmd, fx.locked], True, "permission denied")
                    for cmd in ("stats", "verify", "gc")]
    free_text = [
        ("serve --port 70000", ["serve", "--port", "70000"]),
        ("serve --device bogus", ["serve", "--device", "bogus"]),
        ("serve --device cuda:-1", ["serve", "--device", "cuda:-1"]),
        ("serve --log-level bogus", ["serve", "--log-level", "bogus"]),
        ("demo --remote-blocks bogus", ["demo", "--remote-blocks", "bogus://x"]),
        ("demo --remote-snapshots bogus", ["demo", "--remote-snapshots", "redis:/x"]),
        ("eval --device bogus", ["eval", "--device", "bogus"]),
    ]
    return ([(label, argv, False, expect) for label, argv, expect in named] + unsearchable
            + [(label, argv, False, None) for label, argv in free_text]
            + [(f"plan --config {k}", ["plan", "--config", v], False, None) for k, v in fx.plan_configs.items()])


@pytest.fixture(scope="module")
def fixtures():
    root = Path(tempfile.mkdtemp(prefix="dsv41-hostile-"))
    try:
        yield Fixtures(root)
    finally:
        os.chmod(root / "locked", stat.S_IRWXU)
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def store(fixtures):
    """A small persistent store with records in it (gc must keep them)."""
    import numpy as np

    from .cache.helpers import B, key, open_store, rand_tokens, write_chain
    path = fixtures.root / "store"
    with open_store(path) as st:
        write_chain(st, rand_tokens(np.random.default_rng(0), 3 * B), key())
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o755 if p.is_dir() else p.stat().st_mode | 0o644)
    return path


def run_all(cases: list[tuple[str, list[str], bool, str | None]], cwd: Path) -> list[dict]:
    """Runs the cases in cwd (where a command that wrongly started would write)."""
    req = {"jobs": 2, "timeout_s": DEADLINE_S, "cwd": str(cwd), "preload": PRELOAD,
           "cases": [{"argv": argv, "unprivileged": unpriv} for _, argv, unpriv, _ in cases]}
    p = subprocess.run([sys.executable, str(ZYGOTE)], input=json.dumps(req), capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [str(Path(__import__("dsv41").__file__).resolve().parents[1]),
                            os.environ.get("PYTHONPATH", "")])))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def problem(res: dict, expect: str | None = None) -> str | None:
    """What is wrong with one case's outcome (its message must contain `expect`), or None."""
    if res.get("timed_out"):
        return f"no exit within {DEADLINE_S:g} s (a hang)"
    err = res["stderr"]
    if "Traceback" in err:
        return "a traceback:\n" + err[-1500:]
    if res["rc"] not in (1, 2):
        return f"exit status {res['rc']}:\n{err[-500:]}{res['stdout'][-300:]}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if not lines or not lines[-1].startswith("dsv41") or len(lines[-1]) > 400:
        return f"not a one-line dsv41 message: {err[-500:]!r}"
    if "internal error" in lines[-1]:
        return f"an internal error, not a clear message: {lines[-1]}"
    if expect is not None and expect.lower() not in lines[-1].lower():
        return f"the message does not say {expect!r}: {lines[-1]}"
    return None


def test_every_command_answers_hostile_input_with_a_one_line_error(fixtures, store):
    unranged: list[str] = []
    cases = discovered_cases(fixtures, unranged) + hand_cases(fixtures, str(store))
    assert not unranged, f"numeric options without a declared range (use dsv41.argcheck): {unranged}"
    commands = {" ".join(w) for w, _ in leaves(build_parser())}
    assert {"info", "kv-bytes", "plan", "digest", "demo", "eval", "serve", "cache gc"} <= commands
    scratch = fixtures.root / "cwd"
    scratch.mkdir(mode=0o777)
    results = run_all(cases, scratch)
    bad = {label: why for (label, _, _, expect), res in zip(cases, results) if (why := problem(res, expect))}
    assert not bad, f"{len(bad)} of {len(cases)} cases:\n" + "\n".join(f"- {k}: {v}" for k, v in bad.items())
    # gc refused the capacities below one record: every record is still there
    from .cache.helpers import open_store
    with open_store(store, mode="r") as st:
        assert len(st) == 3
