"""Slurm batch jobs as a launch script meets them: `#SBATCH` lines, the SLURM_* variables sbatch
gives the job's shell, and `sbatch <<EOF` here-documents (the job script inside is read).

sbatch reads `#SBATCH` options up to the script's first command; the job's shell then sees
SLURM_NNODES (and SLURM_JOB_NUM_NODES), SLURM_NTASKS_PER_NODE, SLURM_NTASKS and SLURM_GPUS_PER_NODE
for the options that set them (Slurm's sbatch documentation, "OUTPUT ENVIRONMENT VARIABLES").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inspector.inputs.bash.shell import Shell

_NAMES = {"-N": "nodes", "--nodes": "nodes", "-n": "tasks", "--ntasks": "tasks",
          "--ntasks-per-node": "per_node", "--gpus-per-node": "gpus"}  # fmt: skip


def sbatch_options(text: str) -> tuple[str, ...]:
    """Return the options of a script's `#SBATCH` lines (sbatch reads them up to the first
    command); srun inside the job takes its node and task counts from them."""
    words: list[str] = []
    for line in text.splitlines()[1 if text.startswith("#!") else 0 :]:
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            words.extend(stripped[len("#SBATCH") :].split("#", 1)[0].split())
        elif stripped and not stripped.startswith("#"):
            break
    return tuple(words)


def batch_counts(options: Sequence[str]) -> dict[str, str]:
    """Return {"nodes", "tasks", "per_node", "gpus"} as sbatch's options give them (last wins)."""
    found: dict[str, str] = {}
    words = list(options)
    for index, word in enumerate(words):
        option, equals, inline = word.partition("=")
        if option in _NAMES and option.startswith("--") and equals:
            found[_NAMES[option]] = inline
        elif word in _NAMES and index + 1 < len(words):
            found[_NAMES[word]] = words[index + 1]
        elif re.fullmatch(r"-[Nn]\d+", word):
            found[_NAMES[word[:2]]] = word[2:]
    if "gpus" in found:  # `--gpus-per-node=h100:8`
        found["gpus"] = found["gpus"].rsplit(":", 1)[-1]
    return {key: value for key, value in found.items() if value.isdigit()}


def slurm_environment(options: Sequence[str]) -> dict[str, str]:
    """The SLURM_* variables a batch job's shell sees for its #SBATCH options."""
    counts = batch_counts(options)
    env: dict[str, str] = {}
    if "nodes" in counts:
        env["SLURM_NNODES"] = env["SLURM_JOB_NUM_NODES"] = counts["nodes"]
    if "per_node" in counts:
        env["SLURM_NTASKS_PER_NODE"] = counts["per_node"]
    if "gpus" in counts:
        env["SLURM_GPUS_PER_NODE"] = counts["gpus"]
    if "tasks" in counts:
        env["SLURM_NTASKS"] = env["SLURM_NPROCS"] = counts["tasks"]
    elif "nodes" in counts and "per_node" in counts:
        tasks = str(int(counts["nodes"]) * int(counts["per_node"]))
        env["SLURM_NTASKS"] = env["SLURM_NPROCS"] = tasks
    return env


def start_job(shell: Shell, options: tuple[str, ...]) -> None:
    """A script with #SBATCH options (or a here-document given to sbatch) runs as a batch job:
    its shell sees Slurm's variables for them, unless --set gives them."""
    shell.batch = options
    for name, value in slurm_environment(options).items():
        if name not in shell.vars:
            shell.vars[name] = value
            shell.exported.add(name)
