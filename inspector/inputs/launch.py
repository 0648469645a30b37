"""Training launch commands: which command is the launch, its program's arguments, and the world
size its launcher starts (torchrun / torch.distributed.run|launch, deepspeed, srun, mpirun).

Megatron-LM computes the data-parallel size from the world size (megatron/training/arguments.py,
validate_args): `total_model_size = tp * pp * cp`, `assert args.world_size % total_model_size == 0`,
`args.data_parallel_size = args.world_size // total_model_size`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inspector.errors import ConfigError
from inspector.inputs.bash.batch import batch_counts
from inspector.inputs.bash.context import program_name

_PYTHON = re.compile(r"python[0-9.]*$")
_WRAPPERS = {"srun", "mpirun", "mpiexec"}
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _is_program(word: str) -> bool:
    name = program_name(word)
    return bool(_PYTHON.match(name)) or name in ("torchrun", "deepspeed") or name in _WRAPPERS


def is_launch(argv: Sequence[str]) -> bool:
    """Whether a command runs a Python training program (a `.py` file) through a known launcher."""
    return bool(argv) and _is_program(argv[0]) and program_index(argv) is not None


def module_as_file(argv: Sequence[str]) -> Sequence[str]:
    """Return a launch that runs its program as a module (`python -m pkg.mod`, torchrun's
    `-m`/`--module pkg.mod`: "interpret the launch script as a Python module", as Megatron-LM's
    MIMO and inference examples run `-m examples.mimo.pretrain_mimo`) with the module spelled as
    its file, pkg/mod.py, so that it is read, or refused by name, as a `.py` program is; any
    other command unchanged."""
    if not argv or not _is_program(argv[0]) or any(w.endswith(".py") for w in argv[1:]):
        return argv
    for index in range(1, len(argv) - 1):
        word, module = argv[index], argv[index + 1]
        if word == "-c":
            return argv
        if word in ("-m", "--module") and re.fullmatch(r"[A-Za-z_][\w.]*", module):
            if module in _TORCHRUN_MODULES:
                continue
            return [*argv[:index], module.replace(".", "/") + ".py", *argv[index + 2 :]]
    return argv


def program_index(argv: Sequence[str]) -> int | None:
    """Where the launched `.py` program stands in a launch command, or None where the command runs
    something else: `python -c CODE` runs CODE and `python -m MODULE` runs MODULE (the words after
    them are that code's arguments), unless MODULE is torch's launcher."""
    index = next((i for i, word in enumerate(argv) if i and word.endswith(".py")), None)
    if index is None:
        return None
    for segment_start, segment in _segment_starts(argv):
        if segment.kind != "python" or segment_start >= index:
            continue
        words = argv[segment_start + 1 : index]
        if "-c" in words or ("-m" in words and _module(segment.words) not in _TORCHRUN_MODULES):
            return None
    return index


def _segment_starts(argv: Sequence[str]) -> list[tuple[int, Segment]]:
    start, out = 0, []
    for segment in segments(argv):
        out.append((start, segment))
        start += len(segment.words)
    return out


def program_arguments(argv: Sequence[str]) -> list[str]:
    """Return the arguments after the launched `.py` program."""
    index = program_index(argv)
    return list(argv[index + 1 :]) if index is not None else []


@dataclass(frozen=True)
class Segment:
    """One launcher in a command: `srun -N 2`, `torchrun --nnodes 2 ...`, `python -u`."""

    kind: str  # "srun", "mpirun", "torchrun", "deepspeed", "python"
    words: tuple[str, ...]  # the launcher and its options, as written


def segments(argv: Sequence[str]) -> list[Segment]:
    """Split a launch command into its launchers, outermost first, up to the `.py` program."""
    out: list[Segment] = []
    index = 0
    while index < len(argv):
        name = program_name(argv[index])
        start = index
        index += 1
        while index < len(argv) and not argv[index].endswith(".py") and not (
            name in _WRAPPERS and _is_program(argv[index]) and not argv[index].startswith("-")
        ):
            index += 1
        words = tuple(argv[start:index])
        kind = "mpirun" if name == "mpiexec" else name
        if _PYTHON.match(name):
            module = _module(words)
            kind = "torchrun" if module in _TORCHRUN_MODULES else "python"
        out.append(Segment(kind, words))
        if index < len(argv) and argv[index].endswith(".py"):
            break
    return out


def _module(words: Sequence[str]) -> str | None:
    for number, word in enumerate(words[:-1]):
        if word == "-m":
            return words[number + 1]
    return None


@dataclass(frozen=True)
class World:
    """The number of processes a launch starts, or None with the reason it is not known."""

    size: int | None
    origin: str  # "torchrun --nproc_per_node 8 --nnodes 4 (train.sh line 40)" or why unknown


# (text, what it is) -> text, or None where the script leaves it unknown (then recorded as missing)
Require = Callable[[str, str], str | None]


def _options(words: Sequence[str], names: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Return {canonical: (value, as written)} for the options of a launcher."""
    found: dict[str, tuple[str, str]] = {}
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        option, equals, inline = word.partition("=")
        if option in names and option.startswith("--") and equals:
            found[names[option]] = (inline, f"{option} {inline}")
        elif word in names and index < len(words):
            found[names[word]] = (words[index], f"{word} {words[index]}")
            index += 1
        elif re.fullmatch(r"-[A-Za-z]\d+", word) and word[:2] in names:
            found[names[word[:2]]] = (word[2:], f"{word[:2]} {word[2:]}")  # srun's -N2
    return found


def _count(value: str, what: str, require: Require) -> int | None:
    text = require(value, what)
    if text is None:
        return None
    return int(text) if re.fullmatch(r"\d+", text) and int(text) > 0 else None


def world_of(argv: Sequence[str], env: dict[str, str], where: str, require: Require,
             sbatch: Sequence[str] = (), outer: Sequence[Sequence[str]] = ()) -> World:  # fmt: skip
    """Return the world size a launch command starts (innermost launcher that decides it); a
    bare `python` inside `srun ... sh -c "..."` runs as one of srun's tasks."""
    parts = segments(argv)
    if not any(part.kind != "python" for part in parts):
        for around in reversed(outer):
            if program_name(around[0]) in _WRAPPERS:
                return _task_world(segments(around)[0], where, require, sbatch)
    for segment in reversed(parts):
        if segment.kind in ("torchrun", "deepspeed"):
            return _launcher_world(segment, where, require, batch_counts(sbatch).get("gpus"))
    for segment in reversed(parts):
        if segment.kind in ("srun", "mpirun"):
            return _task_world(segment, where, require, sbatch)
    size = env.get("WORLD_SIZE")
    if size is not None:
        number = _count(size, "WORLD_SIZE", require)
        if number is not None:
            return World(number, f"WORLD_SIZE={number} ({where})")
    return World(None, f"python starts one process here and the job's environment (WORLD_SIZE) "
                       f"decides the world ({where})")  # fmt: skip


def _launcher_world(segment: Segment, where: str, require: Require,
                    batch_gpus: str | None = None) -> World:  # fmt: skip
    if segment.kind == "torchrun":
        names = {"--nproc_per_node": "per_node", "--nproc-per-node": "per_node",
                 "--nnodes": "nodes"}  # fmt: skip
        default_per_node = "1"
    else:
        names = {"--num_gpus": "per_node", "--num-gpus": "per_node", "--num_nodes": "nodes",
                 "--num-nodes": "nodes"}  # fmt: skip
        default_per_node = ""
    found = _options(segment.words[1:], names)
    launcher = " ".join(segment.words[:1] + (("-m", _module(segment.words) or "")
                                             if segment.words[0] != "torchrun"
                                             and segment.kind == "torchrun" else ()))  # fmt: skip
    shown = " ".join([launcher] + [written for _, written in found.values()])
    per_node_text = found.get("per_node", (default_per_node, ""))[0]
    if batch_gpus and per_node_text in ("gpu", ""):  # every GPU of the node: #SBATCH says how many
        per_node_text = batch_gpus
        shown += f" with #SBATCH --gpus-per-node {batch_gpus}"
    if not per_node_text:
        return World(None, f"{shown} uses every GPU it finds on the job's nodes ({where})")
    per_node = _count(per_node_text, f"{launcher}'s GPUs per node", require)
    if per_node is None:
        return World(None, f"{shown} takes the GPU count from the job's machine ({where})")
    nodes_text = require(found.get("nodes", ("1", ""))[0], f"{launcher}'s node count")
    if nodes_text is None:
        return World(None, f"{shown} on a node count the script leaves unset ({where})")
    low, _, high = nodes_text.partition(":")
    if high and low != high:
        return World(None, f"{shown} is elastic ({low} to {high} nodes) ({where})")
    nodes = _count(low, f"{launcher}'s node count", require)
    if nodes is None:
        raise ConfigError(f"{where}: {launcher} --nnodes {nodes_text} is not a node count")
    return World(per_node * nodes, f"{shown} ({where})")


def _task_world(segment: Segment, where: str, require: Require, sbatch: Sequence[str]) -> World:
    names = {"-N": "nodes", "--nodes": "nodes", "-n": "tasks", "--ntasks": "tasks",
             "-np": "tasks", "--np": "tasks", "--ntasks-per-node": "per_node"}  # fmt: skip
    found = _options(segment.words[1:], names)
    launcher = program_name(segment.words[0])
    shown = " ".join([launcher] + [written for _, written in found.values()])
    if launcher == "srun" and sbatch and "tasks" not in found:
        inherited = {k: v for k, v in _options(sbatch, names).items() if k not in found}
        if inherited:
            found.update(inherited)
            shown += " with #SBATCH " + " ".join(written for _, written in inherited.values())
    if "tasks" in found:
        tasks = _count(found["tasks"][0], f"{launcher}'s task count", require)
        if tasks is not None:
            return World(tasks, f"{shown} ({where})")
    if "nodes" in found and "per_node" in found:
        nodes = _count(found["nodes"][0], f"{launcher}'s node count", require)
        per_node = _count(found["per_node"][0], f"{launcher}'s tasks per node", require)
        if nodes is not None and per_node is not None:
            return World(nodes * per_node, f"{shown} ({where})")
    if launcher == "srun" and "nodes" in found and "per_node" not in found:
        # srun(1): with no task count, one task per node (--ntasks defaults to --nodes)
        nodes = _count(found["nodes"][0], "srun's node count", require)
        if nodes is not None:
            return World(nodes, f"{shown}, one task per node as srun runs it with no task count "
                                f"({where})")  # fmt: skip
    return World(None, f"{shown} takes its task count from the job's allocation ({where})")


def data_parallel_from_world(world_size: int, tp: int, pp: int, cp: int, origin: str) -> int:
    """Return Megatron-LM's data-parallel size for a world, or raise as its validate_args does.

    Megatron-LM (megatron/training/arguments.py, validate_args): `total_model_size = tp * pp * cp`;
    `assert args.world_size % total_model_size == 0`; `data_parallel_size = world_size //
    total_model_size`.
    """
    total = tp * pp * cp
    if world_size % total:
        raise ConfigError(
            f"world size {world_size} (from {origin}) is not divisible by --tp {tp} x --pp {pp} x "
            f"--cp {cp} = {total} ({world_size} % {total} = {world_size % total}), which "
            "Megatron-LM requires (world_size % (tp*pp*cp) == 0)"
        )
    return world_size // total
