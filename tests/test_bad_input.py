"""Bad input, as a new user types it, through the real command line (issue #16).

Every case runs `python -m inspector ...` in a subprocess, in a folder of its own, and asserts:
the exit code (2 unless stated), stderr is exactly one line starting `Error: ` (the exact line
where the case gives it), stdout is empty, no traceback, and every file in the folder is
byte-for-byte, mode-for-mode as it was (nothing half-written, no temporary file left).

Cost: most cases take a fork of one warm process (~30 ms; see FORKER). Cases that need a built
table (`-o`, `--check`, stdout failures) run against a result cache warmed once for the module,
so they skip the build. Cases run in a small thread pool; the module takes well under a
minute on two busy cores. Cases whose fix lies outside output/cache/tables are strict xfails
that name the issue's category, so they flip to failures (remove the mark) once fixed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # ~300 commands, each in its own process, run by one shared fixture: ~18 s of CPU

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
SMALL += ["--vocab-size", "1000"]
MEMORY = ["memory", *SMALL, "--micro-batch-size", "1"]
PARAMS = ["params", *SMALL]
ERRORS_PAGE = (Path(__file__).resolve().parent.parent / "docs" / "errors.md").read_text()
ERROR_ROW = re.compile(r"^\| (.+?) \| `inspect-model (.+?)` \| `(Error: .+)` \|$", re.M)
ROOT = os.geteuid() == 0
HEADER = "name;module;shape;partitioning_ranks;precs"


@dataclass(frozen=True)
class Case:
    """One bad input: the command line, the files it finds, and what it must answer."""

    id: str
    argv: tuple[str, ...]
    files: Callable[[Path, Warm], None] | None = None
    message: str | None = None  # the exact stderr line; {folder} is the case's real folder
    contains: tuple[str, ...] = ()  # words the Error: line must hold (where exact is too brittle)
    shell: str | None = None  # a bash wrapper, {cmd} is the command: "ulimit -f 1; exec {cmd}"
    stdin: bytes | None = None
    env: dict[str, str] = field(default_factory=dict)
    cached: bool = False  # run against the warmed result cache (needs a built table)
    code: int = 2
    stdout_captured: bool = True
    changes: tuple[str, ...] = ()  # files the shell itself may change (a `> out.txt`)
    xfail: str | None = None
    names: tuple[str, ...] = ()  # the Error: line must name one of these (a flag or its alias)
    not_root: bool = False  # permissions mean nothing to root
    alone: bool = False  # run as a process of its own, not forked (see FORKER)


@dataclass(frozen=True)
class Warm:
    """A result cache that already holds the small model's outputs, and those outputs."""

    cache: Path
    csv: str
    json: str


def case(id: str, *argv: str, **kwargs: Any) -> Case:
    return Case(id, tuple(argv), **kwargs)


def write(name: str, content: str | bytes) -> Callable[[Path, Warm], None]:
    def make(folder: Path, warm: Warm) -> None:
        data = content.encode() if isinstance(content, str) else content
        (folder / name).write_bytes(data)

    return make


def write_all(*files: tuple[str, str]) -> Callable[[Path, Warm], None]:
    def make(folder: Path, warm: Warm) -> None:
        for name, content in files:
            write(name, content)(folder, warm)

    return make


def several(*makers: Callable[[Path, Warm], None]) -> Callable[[Path, Warm], None]:
    def make(folder: Path, warm: Warm) -> None:
        for maker in makers:
            maker(folder, warm)

    return make


def table(name: str = "t.csv", edit: Callable[[str], str] = lambda text: text) -> Any:
    def make(folder: Path, warm: Warm) -> None:
        (folder / name).write_bytes(edit(warm.csv).encode())

    return make


def json_table(edit: Callable[[dict[str, Any]], Any], name: str = "bad.json") -> Any:
    def make(folder: Path, warm: Warm) -> None:
        data = json.loads(warm.json)
        edited = edit(data)
        data = data if edited is None else edited
        (folder / name).write_text(json.dumps(data))
        (folder / "t.csv").write_text(warm.csv)

    return make


def param(index: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["parameters"][index][key] = value

    return edit


def drop(index: int, key: str) -> Callable[[dict[str, Any]], None]:
    return lambda data: data["parameters"][index].pop(key) and None


def folder_named(name: str) -> Callable[[Path, Warm], None]:
    return lambda folder, warm: (folder / name).mkdir()


def link(name: str, target: str) -> Callable[[Path, Warm], None]:
    return lambda folder, warm: (folder / name).symlink_to(target)


def fifo(name: str) -> Callable[[Path, Warm], None]:
    return lambda folder, warm: os.mkfifo(folder / name)


def unix_socket(name: str) -> Callable[[Path, Warm], None]:
    def make(folder: Path, warm: Warm) -> None:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(folder / name))
        server.close()

    return make


def read_only(name: str, mode: int) -> Callable[[Path, Warm], None]:
    def make(folder: Path, warm: Warm) -> None:
        path = folder / name
        if not path.exists():
            path.write_text("old\n")
        path.chmod(mode)

    return make


OLD = write("old.csv", "old table\n")
TOO_LONG = "a" * 300 + ".csv"
OUTPUT_CASES = [
    # -o names something that is not a file we may replace (issue #16 categories 1 and 2)
    case("o-empty", *PARAMS, "-o", "", cached=True,
         message="Error: -o needs a file name, got an empty one (use -o - for standard output)"),
    case("o-empty-long-form", *PARAMS, "--output=", cached=True,
         message="Error: -o needs a file name, got an empty one (use -o - for standard output)"),
    case("o-new-folder-slash", *PARAMS, "-o", "newdir/", cached=True,
         message="Error: -o newdir/ ends in '/', so it names a folder, not a file"),
    case("o-existing-folder-slash", *PARAMS, "-o", "out/", files=folder_named("out"),
         cached=True, message="Error: -o out/ is a folder, not a file"),
    case("o-existing-folder", *PARAMS, "-o", "out", files=folder_named("out"), cached=True,
         message="Error: -o out is a folder, not a file"),
    case("o-dot", *PARAMS, "-o", ".", cached=True, message="Error: -o . is a folder, not a file"),
    case("o-dotdot", *PARAMS, "-o", "..", cached=True,
         message="Error: -o .. is a folder, not a file"),
    case("o-root", *PARAMS, "-o", "/", cached=True, message="Error: -o / is a folder, not a file"),
    case("o-folder-dot", *PARAMS, "-o", "out/.", files=folder_named("out"), cached=True,
         message="Error: -o out/. is a folder, not a file"),
    case("o-missing-folder", *PARAMS, "-o", "missing/t.csv", cached=True,
         message="Error: -o missing/t.csv: folder {folder}/missing does not exist"),
    case("o-missing-folders", *PARAMS, "-o", "a/b/c/t.csv", cached=True,
         message="Error: -o a/b/c/t.csv: folder {folder}/a/b/c does not exist"),
    case("o-file-as-folder", *PARAMS, "-o", "old.csv/t.csv", files=OLD, cached=True,
         message="Error: -o old.csv/t.csv: old.csv is not a folder"),
    case("o-file-as-folder-deep", *PARAMS, "-o", "old.csv/x/t.csv", files=OLD, cached=True,
         message="Error: -o old.csv/x/t.csv: old.csv is not a folder"),
    case("o-name-too-long", *PARAMS, "-o", TOO_LONG, cached=True,
         contains=("-o aaaa", "(304 characters)", "file name too long")),
    case("o-dev-full", *PARAMS, "-o", "/dev/full", cached=True,
         message="Error: -o /dev/full is a character device, not a regular file; -o writes "
         "regular files only (use -o - for standard output)"),
    case("o-dev-zero", *PARAMS, "-o", "/dev/zero", cached=True,
         contains=("-o /dev/zero is a character device",)),
    case("o-dev-stdout-pipe", *PARAMS, "-o", "/dev/stdout", cached=True, alone=True,
         contains=("-o /dev/stdout is a fifo (named pipe), not a regular file",)),
    case("o-fifo", *PARAMS, "-o", "pipe", files=fifo("pipe"), cached=True,
         message="Error: -o pipe is a fifo (named pipe), not a regular file; -o writes regular "
         "files only (use -o - for standard output)"),
    case("o-socket", *PARAMS, "-o", "sock", files=unix_socket("sock"), cached=True,
         contains=("-o sock is a socket, not a regular file",)),
    case("o-symlink-loop", *PARAMS, "-o", "loop", files=link("loop", "loop"), cached=True,
         message="Error: -o loop: too many levels of symbolic links"),
    case("o-symlink-to-folder", *PARAMS, "-o", "to-out",
         files=several(folder_named("out"), link("to-out", "out")), cached=True,
         message="Error: -o to-out is a folder, not a file"),
    case("o-symlink-to-device", *PARAMS, "-o", "to-full", files=link("to-full", "/dev/full"),
         cached=True, contains=("-o to-full is a character device",)),
    case("o-dangling-symlink-missing-folder", *PARAMS, "-o", "dangling",
         files=link("dangling", "missing/t.csv"), cached=True,
         message="Error: -o dangling: folder {folder}/missing does not exist"),
    case("o-file-size-limit-existing", *PARAMS, "-o", "old.csv", files=OLD, cached=True,
         shell="ulimit -f 1; exec {cmd}",
         message="Error: -o old.csv: cannot write: file too large"),
    case("o-file-size-limit-new", *PARAMS, "-o", "new.csv", cached=True,
         shell="ulimit -f 1; exec {cmd}",
         message="Error: -o new.csv: cannot write: file too large"),
    case("o-proc-folder", *PARAMS, "-o", "/proc/t.csv", cached=True,
         contains=("-o /proc/t.csv: cannot create a file in folder /proc",)),
    case("o-sys-folder", *PARAMS, "-o", "/sys/t.csv", cached=True, contains=("-o /sys/t.csv",)),
    case("o-read-only-folder", *PARAMS, "-o", "ro/t.csv",
         files=several(folder_named("ro"), read_only("ro", 0o555)), cached=True, not_root=True,
         message="Error: -o ro/t.csv: cannot create files in folder {folder}/ro "
         "(permission denied)"),
    case("o-read-only-file", *PARAMS, "-o", "old.csv", files=several(OLD, read_only("old.csv", 0o444)),
         cached=True, not_root=True, message="Error: -o old.csv is read-only (permission denied)"),
    case("o-deleted-working-folder", *PARAMS, "-o", "t.csv", cached=True,
         shell="mkdir gone && cd gone && rmdir ../gone && exec {cmd}",
         message="Error: -o t.csv: the working folder no longer exists"),
    case("o-memory-into-folder", *MEMORY, "-o", "out", files=folder_named("out"), cached=True,
         message="Error: -o out is a folder, not a file"),
    case("o-memory-missing-folder", *MEMORY, "-o", "missing/m.txt", cached=True,
         message="Error: -o missing/m.txt: folder {folder}/missing does not exist"),
]

FULL = "Error: cannot write to standard output (no space left on device)"
CLOSED = "Error: cannot write to standard output (it is closed)"
STREAM_CASES = [
    # standard output or input that cannot be used (issue #16 category 2)
    case("stdout-full-params", *PARAMS, cached=True, shell="exec {cmd} > /dev/full",
         stdout_captured=False, message=FULL),
    case("stdout-full-params-json", *PARAMS, "--format", "json", cached=True,
         shell="exec {cmd} > /dev/full", stdout_captured=False, message=FULL),
    case("stdout-full-memory-bars", *MEMORY, cached=True, shell="exec {cmd} > /dev/full",
         stdout_captured=False, message=FULL),
    case("stdout-full-tree", "tree", *SMALL, cached=True, shell="exec {cmd} > /dev/full",
         stdout_captured=False, message=FULL),
    case("stdout-full-models", "models", shell="exec {cmd} > /dev/full", stdout_captured=False,
         message=FULL),
    case("stdout-full-help", "--help", shell="exec {cmd} > /dev/full", stdout_captured=False,
         message=FULL),
    case("stdout-full-command-help", "params", "--help", shell="exec {cmd} > /dev/full",
         stdout_captured=False, message=FULL),
    case("stdout-full-version", "--version", shell="exec {cmd} > /dev/full",
         stdout_captured=False, message=FULL),
    case("stdout-full-diff", "diff", "t.csv", "other.csv",
         files=several(table(), table("other.csv", lambda t: t.replace("(1024, 64)", "(1024, 65)"))),
         shell="exec {cmd} > /dev/full", stdout_captured=False, message=FULL),
    case("stdout-full-check", *PARAMS, "--check", "t.csv", files=table(), cached=True,
         shell="exec {cmd} > /dev/full", stdout_captured=False, message=FULL),
    case("stdout-full-dash-o", *PARAMS, "-o", "-", cached=True, shell="exec {cmd} > /dev/full",
         stdout_captured=False, message=FULL),
    case("stdout-closed-params", *PARAMS, cached=True, shell="exec {cmd} >&-",
         stdout_captured=False, message=CLOSED),
    case("stdout-closed-models", "models", shell="exec {cmd} >&-", stdout_captured=False,
         message=CLOSED),
    case("stdout-closed-memory", *MEMORY, cached=True, shell="exec {cmd} >&-",
         stdout_captured=False, message=CLOSED),
    case("stdout-closed-diff", "diff", "t.csv", "t.csv", files=table(),
         shell="exec {cmd} >&-", stdout_captured=False, message=CLOSED),
    case("stdout-file-size-limit", *PARAMS, cached=True, shell="ulimit -f 1; exec {cmd} > out.txt",
         stdout_captured=False, changes=("out.txt",),
         message="Error: cannot write to standard output (file too large)"),
    case("stdout-closed-and-bad-flag", "tree", "--tp", "5", shell="exec {cmd} >&-",
         stdout_captured=False,
         message="Error: --num-attention-heads 12 is not divisible by --tp 5 (12 % 5 = 2)"),
    case("stdin-closed", "diff", "-", "t.csv", files=table(), shell="exec {cmd} <&-",
         message="Error: - (standard input) is closed"),
    case("stdin-not-utf8", "diff", "-", "t.csv", files=table(), stdin=b"\xff\xfe\x00garbage",
         contains=("- (standard input) is not UTF-8 text",)),
    case("stdin-empty", "diff", "-", "t.csv", files=table(), stdin=b"",
         contains=("- is not an inspect-model params table",)),
    case("stdin-both", "diff", "-", "-", message="Error: only one of OLD and NEW can be - "
         "(standard input)"),
]

NOT_TABLE = "is not an inspect-model params table (line {line}: expected the header {header!r}"


def not_table(name: str, line: int = 1) -> str:
    return f"{name} " + NOT_TABLE.format(line=line, header=HEADER)


TABLE_CASES = [
    # files given to diff / --check that are not params tables (issue #16 category 6)
    case("diff-missing-file", "diff", "missing.csv", "t.csv", files=table(),
         message="Error: missing.csv does not exist"),
    case("diff-folder", "diff", "out", "t.csv", files=several(table(), folder_named("out")),
         message="Error: out is a folder, not a file"),
    case("diff-dev-zero", "diff", "/dev/zero", "t.csv", files=table(),
         message="Error: /dev/zero is a device, not a file"),
    case("diff-empty-file", "diff", "empty.csv", "t.csv", files=several(table(), write("empty.csv", "")),
         contains=(not_table("empty.csv"), "got '(end of file)'")),
    case("diff-prose", "diff", "notes.txt", "t.csv",
         files=several(table(), write("notes.txt", "hello\nworld\n")),
         contains=(not_table("notes.txt"),)),
    case("diff-latin1", "diff", "l1.csv", "t.csv",
         files=several(table(), write("l1.csv", "name;m\xe9;(1,);0;[]\n".encode("latin-1"))),
         contains=("l1.csv is not UTF-8 text",)),
    case("diff-utf16", "diff", "u16.csv", "t.csv",
         files=several(table(), lambda f, w: (f / "u16.csv").write_bytes(w.csv.encode("utf-16"))),
         contains=("u16.csv is not UTF-8 text",)),
    case("diff-binary", "diff", "blob.bin", "t.csv",
         files=several(table(), write("blob.bin", bytes(range(256)) * 4)),
         contains=("blob.bin is not UTF-8 text",)),
    case("diff-topology-only", "diff", "top.csv", "t.csv",
         files=several(table(), table("top.csv", lambda t: t.splitlines()[0] + "\n")),
         contains=(not_table("top.csv", line=2),)),
    case("diff-four-fields", "diff", "bad.csv", "t.csv",
         files=several(table(), table("bad.csv", lambda t: t + "x;y;(1,);0\n")),
         contains=("bad.csv line", "expected 5 ';'-separated fields, got 4")),
    case("diff-shape-banana", "diff", "bad.csv", "t.csv",
         files=several(table(), table("bad.csv", lambda t: t + "x;y;(banana);0;[]\n")),
         contains=("bad.csv line", "expected name;module;(shape);ranks;precs")),
    case("diff-owners-word", "diff", "bad.csv", "t.csv",
         files=several(table(), table("bad.csv", lambda t: t + "x;y;(1,);zero;[]\n")),
         contains=("bad.csv line", "expected name;module;(shape);ranks;precs")),
    case("diff-owners-arabic-digit", "diff", "bad.csv", "t.csv",
         files=several(table(), table("bad.csv", lambda t: t + "x;y;(1,);\u0663;[]\n")),
         contains=("bad.csv line",)),
    case("diff-empty-name", "diff", "bad.csv", "t.csv",
         files=several(table(), table("bad.csv", lambda t: t + ";y;(1,);0;[]\n")),
         contains=("bad.csv line",)),
    case("diff-bad-comment", "diff", "bad.csv", "t.csv",
         files=several(table(), table("bad.csv", lambda t: t + "# hello\n")),
         contains=("bad.csv line", "expected a '# stage S: ...' comment")),
    case("diff-duplicate-row", "diff", "bad.csv", "t.csv",
         files=several(table(), table("bad.csv", lambda t: t + t.splitlines()[3] + "\n")),
         contains=("bad.csv line", "already appears on line 4")),
    case("diff-bad-format", "diff", "t.csv", "t.csv", "--format", "html", files=table(),
         contains=("--format 'html' is not one of",)),
    case("check-missing", *PARAMS, "--check", "missing.csv", cached=True,
         message="Error: missing.csv does not exist"),
    case("check-folder", *PARAMS, "--check", "out", files=folder_named("out"), cached=True,
         message="Error: out is a folder, not a file"),
    case("check-prose", *PARAMS, "--check", "notes.txt", files=write("notes.txt", "hi\n"),
         cached=True, contains=(not_table("notes.txt"),)),
    case("check-json-banana", *PARAMS, "--check", "bad.json", cached=True,
         files=json_table(param(0, "shape", "banana")),
         message='Error: bad.json: parameters[0].shape must be a list of non-negative integers, '
         'got "banana"'),
]


def _json_case(id: str, edit: Any, message: str) -> Case:
    return case(f"json-{id}", "diff", "bad.json", "t.csv", files=json_table(edit),
                message=f"Error: bad.json{message}")


LIST = "must be a list of non-negative integers"
RANKS = "must be a list of non-negative integers (empty for a frozen parameter)"
JSON_CASES = [
    _json_case("shape-banana", param(1, "shape", "banana"),
               f': parameters[1].shape {LIST}, got "banana"'),
    _json_case("shape-float", param(0, "shape", [1.5]), f": parameters[0].shape {LIST}, got [1.5]"),
    _json_case("shape-bool", param(0, "shape", [True]), f": parameters[0].shape {LIST}, got [true]"),
    _json_case("shape-negative", param(0, "shape", [-1]), f": parameters[0].shape {LIST}, got [-1]"),
    _json_case("shape-nan", param(0, "shape", [float("nan")]),
               f": parameters[0].shape {LIST}, got [NaN]"),
    _json_case("shape-null", param(0, "shape", None), f": parameters[0].shape {LIST}, got null"),
    _json_case("shape-object", param(0, "shape", {"a": 1}),
               f': parameters[0].shape {LIST}, got {{"a": 1}}'),
    _json_case("ranks-int", param(0, "partitioning_ranks", 3),
               f": parameters[0].partitioning_ranks {RANKS}, got 3"),
    _json_case("ranks-strings", param(0, "partitioning_ranks", ["0"]),
               f': parameters[0].partitioning_ranks {RANKS}, got ["0"]'),
    _json_case("dtype-int8", param(0, "dtype", "int8"),
               ': parameters[0].dtype must be one of float32, bfloat16, float16, got "int8"'),
    _json_case("missing-dtype", drop(2, "dtype"), ": parameters[2] has no 'dtype' field"),
    _json_case("missing-name", drop(0, "name"), ": parameters[0] has no 'name' field"),
    _json_case("missing-shape", drop(0, "shape"), ": parameters[0] has no 'shape' field"),
    _json_case("name-empty", param(0, "name", ""),
               ': parameters[0].name must be a non-empty string, got ""'),
    _json_case("name-number", param(0, "name", 7),
               ": parameters[0].name must be a non-empty string, got 7"),
    _json_case("module-list", param(0, "module", ["x"]),
               ': parameters[0].module must be a string, got ["x"]'),
    _json_case("stage-negative", param(0, "stage", -1),
               ": parameters[0].stage must be a non-negative integer, got -1"),
    _json_case("stage-string", param(0, "stage", "0"),
               ': parameters[0].stage must be a non-negative integer, got "0"'),
    _json_case("chunk-string", param(0, "chunk", "a"),
               ': parameters[0].chunk must be a non-negative integer or null, got "a"'),
    _json_case("precs-nested", param(0, "precs", [[[1]]]),
               ": parameters[0].precs must be a list of [d, d] pairs or null, got [[[1]]]"),
    _json_case("precs-triple", param(0, "precs", [[1, 2, 3]]),
               ": parameters[0].precs must be a list of [d, d] pairs or null, got [[1, 2, 3]]"),
    _json_case("parameter-list", lambda d: d["parameters"].__setitem__(0, [1, 2]),
               ": parameters[0] must be an object, got a list"),
    _json_case("parameter-string", lambda d: d["parameters"].__setitem__(1, "x"),
               ": parameters[1] must be an object, got a string"),
    _json_case("parameter-null", lambda d: d["parameters"].__setitem__(0, None),
               ": parameters[0] must be an object, got null"),
    _json_case("parameter-number", lambda d: d["parameters"].__setitem__(0, 4),
               ": parameters[0] must be an object, got a number"),
    _json_case("duplicate-name", lambda d: d["parameters"].append(d["parameters"][0]),
               ": parameters[28].name 'embedding.word_embeddings.weight' already appears in "
               "parameters[0]"),
    _json_case("parameters-number", lambda d: d.__setitem__("parameters", 5),
               ' is JSON but not an inspect-model params table (no "parameters" list at the top '
               "level)"),
    _json_case("parameters-missing", lambda d: d.pop("parameters") and None,
               ' is JSON but not an inspect-model params table (no "parameters" list at the top '
               "level)"),
    _json_case("topology-number", lambda d: d["header"]["topology"].__setitem__("line", 5),
               ": header.topology.line must be a string or null"),
    case("json-invalid", "diff", "bad.json", "t.csv",
         files=several(table(), write("bad.json", '{"parameters": [')),
         message="Error: bad.json line 1 column 17: not valid JSON (Expecting value)"),
    case("json-deep", "diff", "bad.json", "t.csv",
         files=several(table(), write("bad.json", '{"parameters":' + "[" * 100000)),
         contains=("bad.json",)),
    case("json-array", "diff", "bad.json", "t.csv",
         files=several(table(), write("bad.json", "[1, 2]\n")),
         contains=(not_table("bad.json"),)),
]

ELSEWHERE_CASES = [
    # Bad input checked by config, memory, topology and the walkthrough.
    case("choice-normalization", "tree", *SMALL, "--normalization", "rmsnorm",
         message="Error: --normalization 'rmsnorm' is not one of: LayerNorm, RMSNorm"),
    case("choice-position-embedding", "tree", "--position-embedding-type", "rop",
         message="Error: --position-embedding-type 'rop' is not one of: learned_absolute, "
         "rope, yarn, none"),
    case("choice-transformer-impl", "tree", "--transformer-impl", "fast",
         message="Error: --transformer-impl 'fast' is not one of: local, transformer_engine"),
    case("choice-recompute", *MEMORY, "--recompute-granularity", "bogus",
         message="Error: --recompute-granularity 'bogus' is not one of: none, selective, full"),
    # Non-finite numbers (#16 category 4): every float option refuses nan and infinities, as
    # typed (Python reads 1e400 as inf); the commands' own range checks say "greater than 0".
    *[case(f"non-finite-gpu-memory-{v}", *MEMORY, "--gpu-memory", v,
           message=f"Error: --gpu-memory must be a finite number, got {v}")
      for v in ("nan", "inf", "1e400", "-inf", "NaN", "-1e999")],
    *[case(f"non-finite-gpu-tflops-{v}", *MEMORY, "--gpu-tflops", v,
           message=f"Error: --gpu-tflops must be a finite number, got {v}")
      for v in ("nan", "inf")],
    case("zero-gpu-memory", *MEMORY, "--gpu-memory", "0",
         message="Error: --gpu-memory must be a finite number of GiB greater than 0, got 0.0"),
    case("negative-gpu-tflops", *MEMORY, "--gpu-tflops", "-1",
         message="Error: --gpu-tflops must be a finite number of TFLOP/s greater than 0, got -1.0"),
    case("non-finite-mfu", *MEMORY, "--gpu-tflops", "100", "--mfu", "nan",
         message="Error: --mfu must be a finite number, got nan"),
    case("non-finite-workload-tflops", "workload", *SMALL, "--micro-batch-size", "1",
         "--stage", "0", "--gpu-tflops", "nan",
         message="Error: --gpu-tflops must be a finite number, got nan"),
    *[case(f"non-finite-plan{flag}", "plan", *SMALL, "--gpus", "8", "--global-batch-size", "8",
           "--micro-batch-size", "1", flag, "nan", message=f"Error: {flag} must be a finite number, got nan")
      for flag in ("--gpu-memory", "--gpu-tflops", "--efficiency", "--intra-node-bandwidth",
                   "--inter-node-bandwidth")],
    # Huge integers (#16 category 7): an upper bound naming the flag, before torch sees them.
    case("huge-hidden-size", "tree", "--num-layers", "2", "--num-attention-heads", "4",
         "--hidden-size", "9223372036854775808",
         message="Error: --hidden-size 9223372036854775808 is larger than this tool can simulate "
         "(at most 2147483647)"),
    case("huge-num-layers", "tree", "--num-layers", str(10**30),
         message=f"Error: --num-layers {10**30} is larger than this tool can simulate "
         "(at most 2147483647)"),
    *[case(f"huge-{flag[2:]}", "tree", *SMALL, flag, "9223372036854775808",
           contains=(f"{flag} 9223372036854775808 is larger than this tool can simulate",))
      for flag in ("--tp", "--pp", "--dp", "--vocab-size", "--seq-length", "--ffn-hidden-size",
                   "--kv-channels", "--num-experts")],
    # each flag in range, their product not: a 2**30 head size made megatron's rotary embedding
    # allocate 2 GiB on the host (a plan ran out of memory), its QKV a 25-billion-wide linear
    case("wide-qkv", "params", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads",
         "8", "--kv-channels", str(2**30),
         message="Error: the QKV projection's width (--num-attention-heads 8 + 2 x "
         "--num-query-groups 8) x --kv-channels 1073741824 = 25769803776 is larger than this tool "
         "can simulate (at most 2147483647 a dimension)"),
    case("wide-swiglu-fc1", "params", "--num-layers", "1", "--hidden-size", "64",
         "--num-attention-heads", "8", "--swiglu", "--ffn-hidden-size", str(2**30 + 64),
         contains=("fc1's width 2 x MLP size 1073741888 (--swiglu) = 2147483776 is larger",)),
    case("huge-micro-batch", "memory", *SMALL, "--micro-batch-size", str(2**63),
         contains=("--micro-batch-size", "larger than this tool can simulate")),
    case("huge-block-size", *PARAMS, "--block-size", str(2**64),
         contains=("--block-size", "larger than this tool can simulate")),
    case("huge-ulysses-degree", *MEMORY, "--attention-walkthrough", "--ulysses-degree",
         str(2**64), contains=("--ulysses-degree", "larger than this tool can simulate")),
    # the NullTokenizer's + 1 came first: "--vocab-size must be at least 1, got -4" for -5
    case("null-tokenizer-negative-vocab", "params", "--config", "null.yaml",
         files=write("null.yaml", "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\n"
                     "tokenizer-type: NullTokenizer\nvocab-size: -5\n"),
         message="Error: null.yaml: --vocab-size must be at least 1, got -5"),
    # it named --vocab-size, which nobody gave
    case("empty-gpt2-vocab-file", "params", "--config", "gpt2.yaml",
         files=write_all(("gpt2.yaml", "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\n"
                          "tokenizer-type: GPT2BPETokenizer\nvocab-file: v.json\nmerge-file: m.txt\n"),
                         ("v.json", "{}"), ("m.txt", "#version: 0.2\n")),
         message="Error: v.json: an empty GPT-2 vocabulary (no tokens), which Megatron-LM's "
         "GPT2BPETokenizer loads from --vocab-file"),
    case("duplicate-config-key", "tree", "--config", "dup.yaml",
         files=write("dup.yaml", "num-layers: 2\nnum-layers: 4\n"), contains=("num-layers",)),
    # Conflicting flags (#16 category 9): refused, never silently ignored.
    case("check-with-output", *PARAMS, "--check", "t.csv", "-o", "out.csv", files=table(),
         cached=True, message="Error: --check compares the table with FILE and writes nothing, "
         "-o writes it; pass one of them"),
    *[case(f"walkthrough-with-{flag[2:]}", *MEMORY, "--attention-walkthrough", flag, value,
           message=f"Error: {flag} has no effect with --attention-walkthrough, which prints one "
           "attention layer and no report; pass one of them")
      for flag, value in (("--gpu-memory", "80"), ("--gpu-tflops", "989"), ("--mfu", "0.4"))],
    case("walkthrough-cp-arithmetic", "memory", "--micro-batch-size", "1",
         "--attention-walkthrough", "--cp", "5",
         message="Error: --seq-length 1024 is not divisible by 2 x --context-parallel-size 5 = 10 "
         "(1024 % 10 = 4)"),
]

MESSAGE_CASES = [
    case("misspelt-command", "prams", message="Error: No such command 'prams'. Did you mean "
         "'params'?"),
    case("unknown-command", "frobnicate", message="Error: No such command 'frobnicate'."),
    case("missing-diff-argument", "diff", "t.csv", files=table(),
         message="Error: Missing argument 'NEW'."),
    case("int-flag-word", "tree", "--num-layers", "two",
         contains=("--num-layers", "'two' is not a valid integer")),
    case("float-flag-word", *MEMORY, "--gpu-memory", "lots", contains=("--gpu-memory",)),
    case("flag-without-value", "tree", "--num-layers", contains=("--num-layers",)),
]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ERROR_PAGE_CASES = [
    case(f"errors-page-{re.sub(r'[^a-z0-9]+', '-', what.lower()).strip('-')}", *shlex.split(command),
         message=message.replace("\\|", "|"), files=link("fixtures", str(FIXTURES)))
    for what, command, message in ERROR_ROW.findall(ERRORS_PAGE)
]



def _size_cases() -> list[Case]:
    """Every integer Megatron-LM argument, below one and beyond any machine: one sentence each."""
    from inspector.inputs.arguments import ARGUMENTS

    cases = []
    for spec in ARGUMENTS:
        if spec.type is not int:
            continue
        for label, value in (("negative", "-1"), ("huge", "99999999999999999999")):
            command = (
                [*MEMORY, spec.flag, value] if spec.group == "training" else [*PARAMS, spec.flag, value]
            )
            if spec.name in ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size"):
                command = [command[0], spec.flag, value]
            cases.append(case(f"{label}{spec.flag}", *command, names=(spec.flag, *spec.aliases)))
    return cases


CASES = OUTPUT_CASES + STREAM_CASES + TABLE_CASES + JSON_CASES + ELSEWHERE_CASES
CASES += MESSAGE_CASES + ERROR_PAGE_CASES + _size_cases()


# --- issue #46, second set: readers of Hugging Face, YAML and tokenizer files, the outputs of one
# command, megatron's refusals (each fixed case failed on main before the sweep46b branch) --------

HF_FIXTURES = FIXTURES / "hf"


def hf_file(name: str = "llama3.1-8b.json", **changes: Any) -> Callable[[Path, Warm], None]:
    """config.json: a fixture's config with keys changed (... removes the key)."""

    def make(folder: Path, warm: Warm) -> None:
        data = json.loads((HF_FIXTURES / name).read_text())
        for key, value in changes.items():
            data.pop(key) if value is ... else data.__setitem__(key, value)
        (folder / "config.json").write_text(json.dumps(data))

    return make


def hf_text(edit: Callable[[str], str]) -> Callable[[Path, Warm], None]:
    return write("config.json", edit((HF_FIXTURES / "llama3.1-8b.json").read_text()))


HF_ARGS = ("params", "--hf-config", "config.json")
HF_BAD_VALUES = {
    "hidden-string": ({"hidden_size": "4096"}, "hidden_size"),
    "heads-zero": ({"num_attention_heads": 0}, '"num_attention_heads" must be a whole number of at least 1'),
    "layers-zero": ({"num_hidden_layers": 0}, "num_hidden_layers"),
    "hidden-zero": ({"hidden_size": 0}, "hidden_size"),
    "vocab-zero": ({"vocab_size": 0}, "vocab_size"),
    "ffn-zero": ({"intermediate_size": 0}, "intermediate_size"),
    "kv-not-dividing": ({"num_key_value_heads": 3},
                        '"num_key_value_heads" 3 does not divide "num_attention_heads" 32 (32 % 3 = 2)'),
    "kv-zero": ({"num_key_value_heads": 0}, "num_key_value_heads"),
    "kv-more-than-heads": ({"num_key_value_heads": 64}, '"num_key_value_heads" 64 does not divide'),
    "hidden-1e308": ({"hidden_size": 1e308}, "hidden_size"),
    "hidden-float-whole": ({"hidden_size": 4096.0}, "hidden_size"),
    "head-dim-string": ({"head_dim": "128"}, "head_dim"),
    "head-dim-zero": ({"head_dim": 0}, "head_dim"),
    "rope-scaling-list": ({"rope_scaling": [1, 2]}, "rope_scaling"),
    "rope-type-int": ({"rope_scaling": {"rope_type": 5}}, "rope_type"),
    "model-type-int": ({"model_type": 5}, "model_type"),
    "architectures-ints": ({"architectures": [5]}, '"architectures" must be a list of class names'),
    # sweep46c: Megatron-Bridge dispatches on the class, transformers on model_type: a Llama was built
    "architectures-other-family": ({"architectures": ["MixtralForCausalLM"]},
                                   "\"architectures\" names MixtralForCausalLM (Megatron-Bridge's Mixtral "
                                   "bridge) but \"model_type\" is 'llama'"),
    "dtype-int": ({"torch_dtype": 5}, "torch_dtype"),
    "dtype-fp8": ({"torch_dtype": "float8_e4m3fn"},
                  "\"torch_dtype\" must be one of bfloat16, float16, float32, got 'float8_e4m3fn'"),
    "hidden-act-list": ({"hidden_act": ["silu"]}, "hidden_act"),
    "positions-zero": ({"max_position_embeddings": 0}, "max_position_embeddings"),
    "positions-string": ({"max_position_embeddings": "131072"}, "max_position_embeddings"),
    "tie-int": ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
    "mlp-bias-string": ({"mlp_bias": "true"}, "mlp_bias"),
    "dropout-negative": ({"attention_dropout": -0.5}, '"attention_dropout" must be a finite number from 0 to 1'),
    "dropout-two": ({"attention_dropout": 2.0}, "attention_dropout"),
    "text-config": ({"text_config": {"hidden_size": "big"}}, '"text_config" holds a multimodal'),
    "sliding-window-negative": ({"sliding_window": -1}, "sliding_window"),
}
HF_FAMILY_VALUES = {
    "moe-topk-zero": ("mixtral-8x7b.json", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    "moe-experts-zero": ("mixtral-8x7b.json", {"num_local_experts": 0}, "num_local_experts"),
    "ds-shared-string": ("deepseek-v3.json", {"n_shared_experts": "1"}, "n_shared_experts"),
    "ds-yarn-factor-string": ("deepseek-v3.json", {"rope_scaling": {"type": "yarn", "factor": "40"}},
                              '"factor" must be a finite number'),
    "ds-mtp-negative": ("deepseek-v3.json", {"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    "gptoss-window-zero": ("gpt-oss-20b.json", {"sliding_window": 0},
                           '"sliding_window" must be a whole number of at least 1'),
    "gptoss-layer-types-string": ("gpt-oss-20b.json", {"layer_types": "sliding"}, "layer_types"),
    "qwen-next-heads-string": ("qwen3-next-80b-a3b.json", {"linear_num_value_heads": "32"},
                               "linear_num_value_heads"),
    "qwen-next-interval-zero": ("qwen3-next-80b-a3b.json", {"full_attention_interval": 0},
                                '"full_attention_interval" must be a whole number of at least 1'),
    # keys transformers' config class would fill with its own default model's value
    "mixtral-no-kv-heads": ("mixtral-8x7b.json", {"num_key_value_heads": ...},
                            '"num_key_value_heads" is missing, and transformers would put its'),
    "qwen3-no-head-dim": ("qwen3-8b.json", {"head_dim": ...}, '"head_dim" is missing'),
    "qwen3-moe-no-experts": ("qwen3-30b-a3b.json", {"num_experts": ...}, '"num_experts" is missing'),
    "gptoss-no-experts": ("gpt-oss-20b.json", {"num_local_experts": ...}, '"num_local_experts" is missing'),
    "ds-no-experts": ("deepseek-v3.json", {"n_routed_experts": ...}, '"n_routed_experts" is missing'),
    "ds-no-dense": ("deepseek-v3.json", {"first_k_dense_replace": ...},
                    "\"first_k_dense_replace\" is missing, and transformers would put its default "
                    "model's value there; every DeepSeek-V3 config.json gives it (Megatron-LM's "
                    "--moe-layer-freq)"),
    "ds-no-q-lora": ("deepseek-v3.json", {"q_lora_rank": ...}, '"q_lora_rank" is missing'),
    "qwen-next-no-conv": ("qwen3-next-80b-a3b.json", {"linear_conv_kernel_dim": ...},
                          "(Megatron-LM's --linear-conv-kernel-dim)"),
}
HF_FILES = {
    "top-list": write("config.json", "[1, 2]"),
    "top-string": write("config.json", '"x"'),
    "nan-token": hf_text(lambda t: t.replace('"hidden_size": 4096', '"hidden_size": NaN')),
    "infinity-token": hf_text(lambda t: t.replace('"attention_dropout": 0.0', '"attention_dropout": Infinity')),
    "duplicate-key": hf_text(lambda t: t.replace("{", '{"hidden_size": 8,', 1)),
    "folder": folder_named("config.json"),
    "invalid-utf8": write("config.json", b'{"model_type": "llama\xff\xfe"}'),
    "utf16": lambda folder, warm: (folder / "config.json").write_bytes(
        (HF_FIXTURES / "llama3.1-8b.json").read_text().encode("utf-16")),
    "5000-digits": hf_text(lambda t: t.replace('"hidden_size": 4096', '"hidden_size": ' + "9" * 5000)),
}
HF_CASES = [
    *[case(f"hf-{id}", *HF_ARGS, files=hf_file(**changes), contains=("config.json: ", words))
      for id, (changes, words) in HF_BAD_VALUES.items()],
    *[case(f"hf-{id}", *HF_ARGS, files=hf_file(name, **changes), contains=("config.json: ", words))
      for id, (name, changes, words) in HF_FAMILY_VALUES.items()],
    *[case(f"hf-file-{id}", *HF_ARGS, files=maker, contains=("config.json",))
      for id, maker in HF_FILES.items()],
    case("hf-dev-zero", "params", "--hf-config", "/dev/zero", message="Error: /dev/zero is a device, not a file"),
    case("hf-as-config", "params", "--config", "config.json", files=hf_file(hidden_size="4096"),
         contains=('config.json: "hidden_size" must be a whole number',)),
]  # fmt: skip

# values the Hugging Face reader takes that the job then refuses: the one `Error:` line alone, without the
# mapping's "Ignored from"/"Note from" lines (printed before it on main)
HF_JOB_REFUSALS = [
    case(f"hf-job-{id}", *HF_ARGS, *flags, files=hf_file(name, **changes), message=f"Error: {message}")
    for id, name, changes, flags, message in (
        ("topk-above-experts", "mixtral-8x7b.json", {"num_experts_per_tok": 16}, (),
         "--moe-router-topk 16 is larger than --num-experts 8"),
        ("groups-not-dividing", "deepseek-v3.json", {"n_group": 7}, (),
         "--num-experts 256 is not divisible by --moe-router-num-groups 7 (256 % 7 = 4; megatron-core's "
         "TransformerConfig asserts it)"),
        ("group-topk-above-groups", "deepseek-v3.json", {"topk_group": 9}, (),
         "--moe-router-group-topk 9 is larger than --moe-router-num-groups 8 (megatron-core's "
         "TransformerConfig asserts moe_router_group_topk <= moe_router_num_groups)"),
        ("vocab-1e12", "llama3.1-8b.json", {"vocab_size": 10**12}, (),
         "--vocab-size 1000000000000 is larger than this tool can simulate (at most 2147483647)"),
        ("positions-2e40", "llama3.1-8b.json", {"max_position_embeddings": 2**40}, (),
         "--seq-length 1099511627776 is larger than this tool can simulate (at most 2147483647)"),
        # refused by the build's limits and by megatron-core's own build, after the job's checks
        ("layers-million", "llama3.1-8b.json", {"num_hidden_layers": 10**6}, (),
         "--num-layers 1000000 is more than this tool builds (at most 1024: megatron-core takes about "
         "15 ms to build each layer; docs/limits.md)"),
        ("megatron-refuses-the-build", "llama3.1-8b.json", {},
         ("--num-layers", "1", "--num-experts", "2", "--moe-router-topk", "1", "--disable-bias-linear"),
         "megatron-core refused to build stage 0: Please use --moe-router-pre-softmax when topk is 1. "
         "(--debug shows its traceback)"),
        ("tp-not-dividing-heads", "llama3.1-8b.json", {}, ("--tp", "3"), None),
    )
]  # fmt: skip
HF_JOB_REFUSALS[-1] = replace(HF_JOB_REFUSALS[-1], message=None, contains=("--tp 3",))
HF_CASES += HF_JOB_REFUSALS

TRAIN = ("#!/bin/bash\ntorchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 64 "
         "--num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 "
         "--transformer-impl local {}\n")  # fmt: skip
HF_TOKENIZER = "--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok.json"
NOT_TOKENIZER = 'tok.json: not a Hugging Face tokenizer.json ("model": {"vocab": ...} must map'
TOKENIZER_CASES = [
    case(f"tokenizer-{id}", "topology", "--from-script", "train.sh",
         files=several(write("train.sh", TRAIN.format(words)), write(name, content)),
         contains=(words_in,))
    for id, words, name, content, words_in in (
        ("vocab-string", HF_TOKENIZER, "tok.json", '{"model": {"vocab": "abcdef"}}', NOT_TOKENIZER),
        ("vocab-int", HF_TOKENIZER, "tok.json", '{"model": {"vocab": 7}}', NOT_TOKENIZER),
        ("vocab-list-of-ints", HF_TOKENIZER, "tok.json", '{"model": {"vocab": [1, 2]}}', NOT_TOKENIZER),
        ("no-model", HF_TOKENIZER, "tok.json", '{"added_tokens": []}', NOT_TOKENIZER),
        ("list", HF_TOKENIZER, "tok.json", "[1, 2, 3]", NOT_TOKENIZER),
        ("added-content-list", HF_TOKENIZER, "tok.json",
         '{"model": {"vocab": {"a": 0}}, "added_tokens": [{"content": ["x"]}]}',
         'tok.json: "added_tokens" must be a list of {"content": TOKEN, "id": ID, ...} objects'),
        # sweep46c: ids the tokenizers library (u32) cannot load were counted as tokens
        ("vocab-id-negative", HF_TOKENIZER, "tok.json", '{"model": {"vocab": {"a": -5}}}',
         'tok.json: "model": {"vocab": ...} must map tokens to whole-number ids from 0 to 4294967295'),
        ("vocab-id-fraction", HF_TOKENIZER, "tok.json", '{"model": {"vocab": {"a": 1.5}}}', "whole-number ids"),
        ("added-id-2e40", HF_TOKENIZER, "tok.json",
         '{"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 1099511627776, "content": "x"}]}',
         "(ids from 0 to 4294967295)"),
        ("added-string", HF_TOKENIZER, "tok.json", '{"model": {"vocab": {"a": 0}}, "added_tokens": "x"}',
         '"added_tokens" must be a list'),
        ("deep", HF_TOKENIZER, "tok.json", "[" * 100000, "tok.json: nested more than 64 levels deep"),
        ("5000-digits", HF_TOKENIZER, "tok.json", '{"model": {"vocab": {"a": ' + "9" * 5000 + "}}}",
         "a number has more than 4,300 digits"),
        ("empty", HF_TOKENIZER, "tok.json", "", "tok.json line 1: not valid JSON"),
        ("invalid-utf8", HF_TOKENIZER, "tok.json", b'{"model": {"vocab": {"\xff": 0}}}', "tok.json is not UTF-8"),
        ("gpt2-vocab-list", "--tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt "
         "--vocab-size 1000", "v.json", "[1, 2]", "v.json: not a GPT-2 vocabulary"),
        ("gpt2-vocab-device", "--tokenizer-type GPT2BPETokenizer --vocab-file /dev/zero --merge-file m",
         "m", "", "--tokenizer-type GPT2BPETokenizer --vocab-file /dev/zero is not known here"),
        ("nan-dropout-word", "--vocab-size 1000 --attention-dropout nan", "x", "",
         "--attention-dropout needs float value, got 'nan'"),
    )
]  # fmt: skip

RUNNER = "MODEL_ARGS:\n  --num-layers: 2\n  --hidden-size: 64\n  --num-attention-heads: 4\n"
LAUGHS = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8))
YAML_CASES = [
    case(f"yaml-{id}", "params", "--config", "c.yaml", files=write("c.yaml", text), contains=(words,))
    for id, text, words in (
        ("billion-laughs", LAUGHS + "num-layers: 2\n", "c.yaml: more than 1,000,000 values once its aliases"),
        # sweep46c: a 10 MB flow list took 50 s to reach the value count (120 s under load)
        ("ten-megabytes", "a: [" + "1," * 5_000_000 + "1]\n", "c.yaml: 10,000,007 characters, more than the 1,048,576"),
        ("recursive-list", "a: &a [*a]\nnum-layers: 2\n", "found unconstructable recursive node"),
        ("recursive-map", "a: &a {b: *a}\nnum-layers: 2\n", "found unconstructable recursive node"),
        ("recursive-model-args", "MODEL_ARGS: &a\n  --num-layers: *a\n", "recursive node"),
        ("python-object", "num-layers: !!python/object/apply:os.system ['touch pwned']\n",
         "could not determine a constructor for the tag"),
        ("python-name", "num-layers: !!python/name:os.system\n", "could not determine a constructor"),
        ("custom-tag", "num-layers: !foo 2\n", "could not determine a constructor for the tag '!foo'"),
        ("binary", "num-layers: !!binary aGVsbG8=\n", "--num-layers needs int value"),
        ("set", "num-layers: !!set {2, 3}\n", "--num-layers needs int value"),
        ("timestamp", "num-layers: 2001-12-14\n", "--num-layers needs int value"),
        ("env-vars-list", "ENV_VARS: [1, 2]\n" + RUNNER,
         "c.yaml: ENV_VARS must map variable names to values (the runner exports each NAME=VALUE), not list"),
        ("env-vars-int", "ENV_VARS: 5\n" + RUNNER, "ENV_VARS must map variable names to values"),
        ("env-vars-string", "ENV_VARS: CUDA_DEVICE_MAX_CONNECTIONS=1\n" + RUNNER, "not str"),
        ("env-vars-nested", "ENV_VARS:\n  NVTE_FLASH_ATTN: {a: 1}\n" + RUNNER, "not a nested value"),
        ("env-vars-bad-name", "ENV_VARS:\n  'A B': 1\n" + RUNNER,  # sweep46c: the runner's export refuses it
         "c.yaml: ENV_VARS name 'A B' is not a shell variable name"),
        ("mode-int", "MODE: 5\n" + RUNNER,
         "c.yaml: MODE 5 is not one of: pretraining, rl, inference (Megatron-LM's test runner"),
        ("mode-list", "MODE: [inference]\n" + RUNNER, "MODE ['inference'] is not one of"),
        ("mode-typo", "MODE: pretrain\n" + RUNNER, "MODE 'pretrain' is not one of"),
        ("model-args-nested", RUNNER.replace("2\n", "{a: 2}\n", 1), "--num-layers needs int value"),
        ("model-args-list-nested", RUNNER.replace("2\n", "[[2]]\n", 1), "--num-layers needs int value"),
        ("model-args-fraction", RUNNER.replace("2\n", "2.5\n", 1), "--num-layers needs int value, got '2.5'"),
        ("plain-bool-count", "num-layers: true\n", "--num-layers needs int value, got True"),
        ("plain-string-switch", "num-layers: 2\nbf16: 'false'\n", "--bf16 is a switch (true/false)"),
        ("plain-nan-rate", "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\nattention-dropout: .nan\n",
         "c.yaml: --attention-dropout needs float value, got nan"),
        ("plain-list-choice", "num-layers: 2\nnormalization: [RMSNorm]\n", "--normalization"),
        ("multi-document", "num-layers: 2\n---\nnum-layers: 4\n", "but found another document"),
        ("tab-indent", "MODEL_ARGS:\n\t--num-layers: 2\n", "found character '\\t'"),
        ("bridge-target", "model:\n  _target_: os.system\n  num_layers: 2\n", "unknown argument 'model'"),
        # YAML 1.1 (PyYAML) reads these otherwise than Megatron-LM's runner (yq, YAML 1.2; argparse)
        ("octal", RUNNER.replace("2\n", "010\n", 1), "c.yaml line 2: 010 is 8 to YAML 1.1 (octal, "
         "hexadecimal or base 60) but not to Megatron-LM (argparse's int(), yq's YAML 1.2); write it in decimal"),
        ("hexadecimal", "num-layers: 0x10\n", "c.yaml line 1: 0x10 is 16 to YAML 1.1"),
        ("base-60", "num-layers: 1:30\n", "c.yaml line 1: 1:30 is 90 to YAML 1.1"),
        ("yes-switch", RUNNER + "  --bf16: yes\n", "c.yaml line 5: yes is true to YAML 1.1 but a word to "
         "Megatron-LM's runner (yq's YAML 1.2); write true or false"),
        ("off-switch", "num-layers: 2\nbf16: off\n", "c.yaml line 2: off is false to YAML 1.1"),
    )
] + [
    case("yaml-folder", "params", "--config", "c.yaml", files=folder_named("c.yaml"),
         message="Error: c.yaml is a folder, not a file"),
    case("yaml-dev-zero", "params", "--config", "/dev/zero", message="Error: /dev/zero is a device, not a file"),
]  # fmt: skip

SAME = "name the same file; give each its own"
READ = "a file this command reads; give the output another name"
OLD_SVG = write("a.svg", "old\n")
TWO_NAMES_CASES = [
    case("two-outputs-hard-link", *MEMORY, "--timeline", "a.svg", "-o", "b.svg",
         files=several(OLD_SVG, lambda folder, warm: os.link(folder / "a.svg", folder / "b.svg")),
         message=f"Error: -o b.svg and --timeline a.svg {SAME}"),
    case("two-outputs-through-a-folder-link", *MEMORY, "--timeline", "d/x", "--snapshot", "l/x",
         files=several(folder_named("d"), link("l", "d")), message=f"Error: --snapshot l/x and --timeline d/x {SAME}"),
    case("two-outputs-dotdot", "plan", *SMALL, "--gpus", "8", "--global-batch-size", "8", "--svg", "a/../p.svg",
         "-o", "p.svg", files=folder_named("a"), message=f"Error: -o p.svg and --svg a/../p.svg {SAME}"),
    case("timeline-empty", *MEMORY, "--timeline", "", message="Error: --timeline needs a file name, got an empty one"),
    case("snapshot-empty", *MEMORY, "--snapshot", "", message="Error: --snapshot needs a file name, got an empty one"),
    case("svg-empty", "plan", *SMALL, "--gpus", "8", "--global-batch-size", "8", "--svg", "",
         message="Error: --svg needs a file name, got an empty one"),
    case("timeline-dash", *MEMORY, "--timeline", "-", "-o", "-",
         contains=("--timeline - would write a file named '-', not standard output",)),
    case("snapshot-dash", *MEMORY, "--snapshot", "-", contains=("--snapshot - would write a file named '-'",)),
    case("timeline-missing-folder", *MEMORY, "--timeline", "nodir/x.svg",
         message="Error: --timeline nodir/x.svg: folder {folder}/nodir does not exist"),
    case("timeline-link-to-dev-full", *MEMORY, "--timeline", "full.svg", files=link("full.svg", "/dev/full"),
         contains=("--timeline full.svg is a character device",)),
    case("timeline-folder", *MEMORY, "--timeline", "d", files=folder_named("d"),
         message="Error: --timeline d is a folder, not a file"),
    case("svg-missing-folder", "plan", *SMALL, "--gpus", "8", "--global-batch-size", "8", "--svg", "no/p.svg",
         "-o", "p.txt", files=write("p.txt", "old\n"), message="Error: --svg no/p.svg: folder {folder}/no does not exist"),
    case("o-replaces-the-config", "params", "--config", "c.yaml", "-o", "c.yaml",
         files=write("c.yaml", "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\nvocab-size: 1000\n"),
         message=f"Error: -o c.yaml would replace c.yaml, {READ}"),
    case("timeline-replaces-the-config", "memory", "--config", "c.yaml", "--micro-batch-size", "1",
         "--timeline", "./c.yaml", files=write("c.yaml", "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\n"),
         message=f"Error: --timeline ./c.yaml would replace c.yaml, {READ}"),
    case("svg-replaces-the-script", "plan", "--from-script", "train.sh", "--gpus", "8",
         "--global-batch-size", "8", "--svg", "train.sh",
         files=write("train.sh", TRAIN.format("--vocab-size 1000")),
         message=f"Error: --svg train.sh would replace train.sh, {READ}"),
    case("o-replaces-a-hard-link-of-the-config", "params", "--config", "c.yaml", "-o", "t.csv",
         files=several(write("c.yaml", "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\n"),
                       lambda folder, warm: os.link(folder / "c.yaml", folder / "t.csv")),
         message=f"Error: -o t.csv would replace c.yaml, {READ}"),
]  # fmt: skip

SCALE_CASES = [
    case(f"calibrate-{flag[2:]}-billion", "calibrate", "--gpu", "h100", "--device", "cpu", flag,
         str(10**9), "-o", "k.json",
         message=f"Error: {flag} 1000000000 is more than the 1,000 calls per kernel calibrate makes "
         "(docs/limits.md)")
    for flag in ("--iters", "--warmup")
]  # fmt: skip

NO_LOG_LINES = ("has no Megatron-LM memory report (`[Rank R] (after N iterations) memory (MB) | "
                "allocated: ...`) and no `elapsed time per iteration (ms)` line")
LOG_CASES = [  # a number Megatron-LM never prints: 1e400 was read as 1 ms, 1.2.3 a traceback
    case(f"check-log-{id}", "check", "t.log", *SMALL, "--micro-batch-size", "1", "--gpu", "h100",
         files=write("t.log", line + "\n"), message=f"Error: t.log {NO_LOG_LINES}")
    for id, line in (
        ("exponent", " iteration        1/      10 | elapsed time per iteration (ms): 1e400 |"),
        ("two-dots", " iteration        1/      10 | elapsed time per iteration (ms): 1.2.3 |"),
        ("memory-two-dots", " [Rank 0] (after 1 iterations) memory (MB) | allocated: 1.2.3 | max "
         "allocated: 5 | reserved: 5 | max reserved: 5"),
    )
]  # fmt: skip

FSDP_WORDS = "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format fsdp_dtensor --vocab-size 1000"
LAUNCH_CASES = [  # sweep46c: Megatron-LM's validate_args asserts it; the job went on
    case("fsdp-connections-one", "params", "--from-script", "train.sh",
         files=write("train.sh", TRAIN.replace("torchrun", "export CUDA_DEVICE_MAX_CONNECTIONS=1\ntorchrun")
                     .format(FSDP_WORDS)),
         message="Error: train.sh line 3: --use-megatron-fsdp with CUDA_DEVICE_MAX_CONNECTIONS=1 is refused "
         "by Megatron-LM: validate_args: 'FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset.'"),
    # --set without a launch script was dropped (the job ran without it), its NAME=VALUE unchecked
    case("set-without-a-script", *PARAMS, "--set", "L=4",
         message="Error: --set L=4 gives a value the launch script reads, and there is none: pass "
         "--from-script SCRIPT, or the argument's own flag"),
    case("set-without-equals", *PARAMS, "--set", "FOO", message="Error: --set needs NAME=VALUE, got 'FOO'"),
]  # fmt: skip

CASES += HF_CASES + TOKENIZER_CASES + YAML_CASES + TWO_NAMES_CASES + SCALE_CASES + LOG_CASES
CASES += LAUNCH_CASES


def _marks(c: Case) -> list[Any]:
    marks = []
    if c.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=c.xfail))
    if c.not_root:
        marks.append(pytest.mark.skipif(ROOT, reason="root may write anywhere"))
    return marks


def _environment(c: Case, warm: Warm, folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONIO", "XDG_CACHE"))}
    if c.cached:
        env.update(INSPECT_MODEL_NO_CACHE="0", XDG_CACHE_HOME=str(warm.cache))
    else:
        env.update(INSPECT_MODEL_NO_CACHE="1", XDG_CACHE_HOME=str(folder.parent / "no-cache"))
    env.update(c.env)
    return env


@dataclass
class Outcome:
    returncode: int
    stdout: bytes
    stderr: bytes


def _run_alone(c: Case, folder: Path, warm: Warm) -> Outcome:
    """Run `python -m inspector ARGV` as its own process (through bash for a redirection)."""
    argv = [sys.executable, "-m", "inspector", *c.argv]
    if c.shell:
        argv = ["bash", "-c", c.shell.format(cmd='"$@"'), "bash", *argv]
    result = subprocess.run(
        argv,
        cwd=folder,
        env=_environment(c, warm, folder),
        input=c.stdin if c.stdin is not None else b"",
        capture_output=True,
        timeout=300,
    )
    return Outcome(result.returncode, result.stdout, result.stderr)


# One process imports the CLI once, then forks a child per case: the child sets up its working
# folder, environment and standard streams as a fresh `python -m inspector` would have them
# and calls the console script's entry point, inspector.cli.main. The parent has imported
# megatron-core and the modules most cases reach, and built the click command, so a child pays
# only its own case (~30 ms; a fresh process ~0.2 s to fail on a flag, ~1.5 s to build a model);
# cases about start-up itself (stream encodings, closed descriptors, resource limits, a deleted
# folder) run as processes of their own.
FORKER = r"""
import json, os, sys
from inspector import cli
from inspector.cli import cache
cache._source_hash()
from inspector.world.setup import megatron
megatron()  # torch and megatron-core imported (~1.4 s), so that a child that builds starts warm
import importlib
for name in ("output", "guard", "render.params", "render.diff", "render.tree", "render.memory",
             "report.params", "report.diff", "memory.measure", "inputs.resolve", "world.build"):
    importlib.import_module("inspector." + name)  # what most children import, imported here once
from inspector.cli import entry
import gc
entry._command()  # typer's click command, built once here as each child would build it
gc.freeze()  # a child's collections skip the objects above: their pages stay shared, not copied
codes = []
for job in json.load(sys.stdin):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(job["cwd"])
            os.environ.clear()
            os.environ.update(job["env"])
            for fd, name, flags in ((0, job["stdin"], os.O_RDONLY),
                                    (1, job["stdout"], os.O_WRONLY | os.O_CREAT),
                                    (2, job["stderr"], os.O_WRONLY | os.O_CREAT)):
                opened = os.open(name, flags, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
            sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
            sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
            sys.stderr = sys.__stderr__ = open(
                2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
            code = cli.main(job["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


def _run_forked(cases: list[Case], folders: dict[str, Path], warm: Warm) -> dict[str, Outcome]:
    """Run cases one after another in children forked from one warm process."""
    jobs = []
    for c in cases:
        folder = folders[c.id]
        streams = folder.parent / f"{c.id}.streams"  # one folder per case, so halves never meet
        streams.mkdir()
        (streams / "stdin").write_bytes(c.stdin or b"")
        jobs.append(
            dict(
                argv=list(c.argv),
                cwd=str(folder),
                env=_environment(c, warm, folder),
                **{name: str(streams / name) for name in ("stdin", "stdout", "stderr")},
            )
        )
    result = subprocess.run(
        [sys.executable, "-c", FORKER],
        input=json.dumps(jobs).encode(),
        capture_output=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    codes = json.loads(result.stdout)
    return {
        c.id: Outcome(
            code,
            Path(job["stdout"]).read_bytes(),
            Path(job["stderr"]).read_bytes(),
        )
        for c, job, code in zip(cases, jobs, codes)
    }


def snapshot(folder: Path) -> dict[str, tuple[Any, ...]]:
    """Return every entry under folder: its type, mode, and bytes or link target."""
    state: dict[str, tuple[Any, ...]] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            info = os.lstat(path)
            entry: tuple[Any, ...] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode))
            if stat.S_ISLNK(info.st_mode):
                entry += (os.readlink(path),)
            elif stat.S_ISREG(info.st_mode) and info.st_mode & stat.S_IRUSR:
                entry += (Path(path).read_bytes(),)
            state[os.path.relpath(path, folder)] = entry
    return state


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Warm:
    """Build the small model's outputs once, into a result cache the cached cases hit."""
    home = tmp_path_factory.mktemp("warm-cache")
    out = tmp_path_factory.mktemp("warm-out")
    code = (
        "import contextlib, io; from inspector.cli import main\n"
        f"small = {SMALL!r}; out = {str(out)!r}\n"
        "for argv in (['params', *small, '-o', out + '/t.csv'],\n"
        "             ['params', *small, '--format', 'json', '-o', out + '/t.json'],\n"
        "             ['memory', *small, '--micro-batch-size', '1', '-o', out + '/m.txt'],\n"
        "             ['tree', *small]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(argv) == 0, argv\n"
    )
    env = dict(os.environ, INSPECT_MODEL_NO_CACHE="0", XDG_CACHE_HOME=str(home))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    return Warm(home, (out / "t.csv").read_text(), (out / "t.json").read_text())


@pytest.fixture(scope="module")
def outcomes(warm: Warm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every case (a few at a time) and keep what each left behind."""
    root = tmp_path_factory.mktemp("cases")
    prepared = {}
    for c in CASES:
        folder = root / c.id
        folder.mkdir()
        if c.files:
            c.files(folder, warm)
        prepared[c.id] = (folder, snapshot(folder))

    alone = [c for c in CASES if c.shell or c.env or c.alone]
    forked = [c for c in CASES if not (c.shell or c.env or c.alone)]
    folders = {c.id: prepared[c.id][0] for c in CASES}
    with ThreadPoolExecutor(max_workers=3) as pool:
        halves = [pool.submit(_run_forked, forked[i::2], folders, warm) for i in (0, 1)]
        ran = pool.map(lambda c: _run_alone(c, folders[c.id], warm), alone)
        results = dict(zip([c.id for c in alone], ran))
        for half in halves:
            results.update(half.result())
    done = {
        c.id: (prepared[c.id][0], prepared[c.id][1], results[c.id], snapshot(prepared[c.id][0]))
        for c in CASES
    }
    yield done
    for c in CASES:  # let pytest clean up folders that a case made read-only
        for path in [prepared[c.id][0], *prepared[c.id][0].rglob("*")]:
            if not path.is_symlink() and path.exists():
                path.chmod(0o755 if path.is_dir() else 0o644)


def test_cases_have_unique_ids():
    assert len({c.id for c in CASES}) == len(CASES)


def test_enough_kinds_of_bad_input():
    assert len(CASES) >= 150


@pytest.mark.parametrize("c", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CASES])
def test_bad_input(c: Case, outcomes: dict[str, Any]) -> None:
    folder, before, result, after = outcomes[c.id]
    stderr = result.stderr.decode("utf-8", "replace")
    assert "Traceback" not in stderr, stderr
    assert result.returncode == c.code, stderr
    assert stderr.startswith("Error: ") and stderr.endswith("\n"), stderr
    line = stderr[:-1]
    assert "\n" not in line, stderr
    if c.message is not None:
        assert line == c.message.replace("{folder}", os.path.realpath(folder))
    for words in c.contains:
        assert words in line
    if c.names:
        assert any(name in line for name in c.names), line
    if c.stdout_captured:
        assert result.stdout == b""
    for name in c.changes:
        before.pop(name, None)
        after.pop(name, None)
    assert after == before


# Unusual but valid: a table with CRLF or CR line endings, or a UTF-8 byte-order mark (a
# Windows checkout with core.autocrlf, an editor that adds a BOM) reads as the same table.
ENDINGS = {
    "crlf": lambda text: text.replace("\n", "\r\n").encode(),
    "cr": lambda text: text.replace("\n", "\r").encode(),
    "bom": lambda text: b"\xef\xbb\xbf" + text.encode(),
    "bom-crlf": lambda text: b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode(),
}


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("kind", ["csv", "json"])
def test_diff_ignores_line_endings_and_bom(cli, warm, tmp_path, ending, kind):
    text = warm.csv if kind == "csv" else warm.json
    (tmp_path / "plain").write_text(text)
    (tmp_path / "other").write_bytes(ENDINGS[ending](text))
    result = cli("diff", str(tmp_path / "plain"), str(tmp_path / "other"))
    assert (result.code, result.err) == (0, "")


@pytest.mark.parametrize("ending", ENDINGS)
def test_check_against_a_crlf_or_bom_copy_is_up_to_date(cli, warm, tmp_path, ending):
    committed = tmp_path / "t.csv"
    committed.write_bytes(ENDINGS[ending](warm.csv))
    result = cli("params", *SMALL, "--check", str(committed))
    assert (result.code, result.out) == (0, f"{committed} is up to date\n")
