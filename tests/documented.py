"""The commands a learner is shown, read from where a learner reads them: README.md's code
blocks and the docstring of every ``launch/*.py`` (the command line at its top). Each
``torchrun ...`` and ``python launch/...`` line (with its ``\\`` continuations, leading
``VAR=value`` settings and trailing ``# comment``) is one command, named ``README:n`` or
``<script>:n``. tests/launcher/test_documented_commands.py runs them; a test that runs one of
them for checks of its own (its row there says which) takes the command from here."""
import ast
import pathlib
import re
import shlex
from typing import Dict, List, Optional, Tuple

from mpu_lab.launcher import LAUNCH_DIR

REPO = LAUNCH_DIR.parent
# a command: optional VAR=value settings, then torchrun ... launch/x.py or python launch/x.py
COMMAND = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S*\s+)*"
                     r"(?:torchrun\s.*\blaunch/\w+\.py\b|python3?\s+launch/\w+\.py\b)")


def commands_in(text: str) -> List[str]:
    """The command lines of ``text``, continuations joined, comments dropped, one space
    between words."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i].strip()
        if COMMAND.match(line):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            found.append(" ".join(shlex.split(line, comments=True)))
        i += 1
    return found


def readme_code(text: str) -> str:
    """README.md's code blocks (fenced, or indented by four spaces), prose left out."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    ") or not line.strip():
            kept.append(line)
    return "\n".join(kept)


def launch_docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def documented_commands() -> Dict[str, str]:
    """``{where: command}``, where = ``README:n`` or ``<script>:n`` (n-th command there, from
    1). A command shown in two places runs once, under its first name."""
    places = [("README", readme_code((REPO / "README.md").read_text()))]
    places += [(p.name, launch_docstring(p)) for p in sorted(LAUNCH_DIR.glob("*.py"))]
    out: Dict[str, str] = {}
    for name, text in places:
        for n, command in enumerate(commands_in(text), 1):
            if command not in out.values():
                out[f"{name}:{n}"] = command
    return out


def script_and_flags(command: str) -> Tuple[str, List[str], Optional[int]]:
    """``(script name, its flags, torchrun's --nproc-per-node or None)`` of ``command`` as
    written."""
    words = shlex.split(command)
    at = next(i for i, w in enumerate(words) if re.fullmatch(r"launch/\w+\.py", w))
    nproc = int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words \
        else None
    return words[at].split("/")[1], words[at + 1:], nproc


COMMANDS = documented_commands()
