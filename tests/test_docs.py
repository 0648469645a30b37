"""The docs are the tool's real behaviour: every `$` example runs, the reference is generated,
links resolve, and no page speaks the project's internal vocabulary."""

from __future__ import annotations

import ast
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from tests import docs_examples
from tests.docs_examples import ROOT

DOCS = ROOT / "docs"
PAGES = docs_examples.pages()
# An MTP layer (`m`) in a --pipeline-model-parallel-layout: megatron-core 0.16 builds it, older
# versions refuse it (tests/test_versions.py records each version); such examples run on 0.16+.
NEEDS_0_16 = ",m|"
MEGATRON = tuple(int(part) for part in version("megatron-core").split(".")[:2])
# The layer-wise dist_muon is modelled as megatron-core 0.16-0.17 build it
# (inspector/memory/engine/muon.py), refused by name on other versions: its examples run there only.
NEEDS_MUON = "--optimizer dist_muon"
# Megatron-FSDP's pages show megatron-core 0.16's buffers; other releases' Megatron-FSDP holds
# others for the gpt2-small example (buffers 0.73 GiB on 0.16.1, 0.72 on 0.13.1; in flight 0.57
# on both, 0.55 on 0.19.2), so their output is checked on 0.16 only.
NEEDS_FSDP_0_16 = "--use-megatron-fsdp"
# megatron-core 0.16 added fine-grained activation offloading (pipeline_parallel/
# fine_grained_activation_offload.py); 0.13 refuses the flag by version
NEEDS_OFFLOAD_0_16 = "--fine-grained-activation-offloading"
# The LoRA example's Llama 3 8B holds other activations on other releases, LoRA or not (the same
# job without adapters: 21.05 GiB on megatron-core 0.13.1, 22.30 on 0.16.1): checked on 0.16+
NEEDS_LORA_0_16 = "--lora-rank"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Words for the project's own process, which a user never saw.
# Words of the people who build this tool, not of its users: any "issue" (an upstream bug is cited as
# NVIDIA/Megatron-LM#N), "spec" unless it is megatron's layer spec (local, TE, layer, block spec;
# the --spec flag), sessions, helpers, briefs, worktrees, and paths outside the repository.
INTERNAL = re.compile(
    r"\b(issues?|sessions?|helpers?|briefs?|worktrees?)\b"
    r"|(?<!layer )(?<!local )(?<!TE )(?<!block )(?<!-)\bspecs?\b"  # "-spec": a flag's name
    r"|(?<![\w/.-])(shared/|/work/)",
    re.I,
)


def _with_examples() -> list[Path]:
    return [page for page in PAGES if docs_examples.examples(page)]


@pytest.mark.slow
@pytest.mark.parametrize("page", _with_examples(), ids=lambda p: p.name)
def test_every_example_prints_what_the_page_shows(cli, page, tmp_path, monkeypatch):
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    monkeypatch.chdir(tmp_path)
    for example in docs_examples.examples(page):
        needs_0_16 = (NEEDS_0_16, NEEDS_OFFLOAD_0_16, NEEDS_LORA_0_16)
        if any(flag in example.command for flag in needs_0_16) and MEGATRON < (0, 16):
            continue
        if NEEDS_MUON in example.command and not (0, 16) <= MEGATRON < (0, 18):
            continue
        code, output = docs_examples.run(example, tmp_path, cli)  # later examples read its files
        if NEEDS_FSDP_0_16 in example.command and MEGATRON[:2] != (0, 16):
            continue
        docs_examples.check(example, code, output)


def test_the_runner_fails_a_wrong_page(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = docs_examples.Example("x.md", 1, "inspect-model topology --pp 2", ("{...): 1}",))
    docs_examples.check(example, *docs_examples.run(example, tmp_path, cli))
    wrong = docs_examples.Example("x.md", 1, "inspect-model topology --pp 2", ("{...): 2}",))
    with pytest.raises(AssertionError):
        docs_examples.check(wrong, *docs_examples.run(wrong, tmp_path, cli))
    page = tmp_path / "page.md"
    page.write_text("text\n\n    $ inspect-model models | head -1 \\\n      | grep preset\n    preset ...\n\nmore\n")
    [found] = docs_examples.examples(page)
    assert (found.command, found.shown) == ("inspect-model models | head -1 | grep preset", ("preset ...",))


def test_the_reference_is_generated_from_the_app(request):
    from inspector.cli.reference import render_reference

    text = render_reference()
    path = DOCS / "reference.md"
    if request.config.getoption("--update-golden"):
        path.write_text(text, encoding="utf-8", newline="\n")
    assert path.read_text(encoding="utf-8") == text, "docs/reference.md is stale: run make golden"
    assert "--help-all" in text and "--num-query-groups" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        path = (page.parent / target).resolve()
        assert path.exists(), (page.name, target)


def test_the_index_links_every_page():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = {(DOCS / target).resolve() for target in LINK.findall(index)}
    missing = [page.name for page in DOCS.glob("*.md") if page.name != "index.md" and page.resolve() not in linked]
    assert not missing, missing


def _code_strings() -> dict[str, str]:
    """Return the package's string constants (messages, help), docstrings left out, by file."""
    strings = {}
    for path in sorted((ROOT / "inspector").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }  # fmt: skip
        found = [
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings
        ]  # fmt: skip
        strings[str(path.relative_to(ROOT))] = "\n".join(found)
    return strings


@pytest.mark.slow
def test_no_internal_vocabulary(cli):
    for internal in ("as the issue says", "see SPEC.md", "GitHub issue 12", "the spec", "specs",
                     "this session", "a helper", "/work/shared/SPEC.md", "in shared/gpu/"):  # fmt: skip
        assert INTERNAL.search(internal), internal
    for user in ("the local layer spec, NVIDIA/Megatron-LM#1658", "the TE spec", "local spec",
                 "the decoder block spec", "--spec", "--export-default-te-spec", "shared experts", "issued", "inspector/x.py"):  # fmt: skip
        assert not INTERNAL.search(user), user
    texts = {page.name: page.read_text(encoding="utf-8") for page in PAGES}
    texts["README.md"] = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in ("tree", "topology", "params", "memory", "plan", "workload", "diff", "models"):
        texts[f"{command} -h"] = cli(command, "-h").out
        texts[f"{command} --help-all"] = cli(command, "--help-all").out
    texts["--help"] = cli("--help").out
    texts.update(_code_strings())  # error messages, notes and help text, as the code spells them
    found = {name: INTERNAL.findall(text) for name, text in texts.items()}
    assert not {name: words for name, words in found.items() if words}


def test_the_readme_is_a_first_screen():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    questions = [line for line in readme.splitlines() if line.startswith("### ")]
    assert len(questions) == 5 and all(q.endswith("?") for q in questions), questions
    for question in questions:  # each answered by one command
        section = readme.split(question)[1].split("\n### ")[0].split("\n## ")[0]
        assert section.count("    $ inspect-model ") == 1, question
