"""The user docs' commands run as written.

Every ```bash block of every README.md and of every page under docs/ is split into commands, and each command
must match a rule of RULES (the first that matches decides):
- RUN: a few seconds, no model: run here, as written, by bash from the repository root;
- SLOW: run too, marked slow: it loads the model or starts processes (under ~30 s each);
- CHECK: not run (a server, a benchmark, minutes of work, a running stack or Docker needed). What can be
  checked without running it is: the executable, module or script exists, input files exist (in the repository
  or written by an earlier command of the same README), make targets and variables exist (`make -n`, and the
  Spindle commands its recipe would run are checked the same way), every --flag appears in the command's own
  --help, and the whole command line parses (its argparse, with --help appended). A curl body is parsed by the
  gateway's own request models and may name only fields they declare;
- GPU: like CHECK, for commands meant for a CUDA machine (a bare `python` / `python3` is allowed there).
A command no rule matches fails test_every_readme_command_is_classified, with what to do.

Outside the blocks, inline `code` that starts like a command (`spindle up --decode-tp 2`, `make bench-engine`)
is checked without running: the command exists and names only flags it has. Fenced blocks without a language
fail: label them bash (commands to run) or text, python, ...

Commands run in a scratch repository root (links to the checkout, bench/ copied with an empty results/), with
the venv off the PATH, so they find only what the README names and what they write stays out of the checkout.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN, SLOW, CHECK, GPU = "run", "slow", "check", "gpu"
SHELL_LANGS = {"bash", "sh", "shell"}
RUN_TIMEOUT_S = 120
HELP_TIMEOUT_S = 60


@dataclass(frozen=True)
class Rule:
    pattern: str  # re.search over the command's words joined by spaces
    kind: str
    why: str


RULES = (
    Rule(r" --help$", RUN, "prints usage"),
    Rule(r"^\.venv/bin/spindle up\b.* --dry-run$", RUN, "prints the service commands"),
    Rule(r"^\.venv/bin/spindle sim --", RUN, "one simulated run of 1,000 requests: about 1 s"),
    Rule(r"^\.venv/bin/spindle sim compare ", RUN, "every strategy on 1,000 requests at one rate: about 5 s"),
    Rule(r"^\.venv/bin/spindle tune tetris .*--num-requests 300 ", RUN, "24 simulated runs of 300 requests: ~5 s"),
    Rule(r"^\.venv/bin/spindle cost ", RUN, "the cost model's breakdown of one operation: milliseconds"),
    Rule(r"^\.venv/bin/python -m spindle_engine\.generate ", SLOW, "loads SmolLM2 and generates: about 3 s"),
    Rule(r"^\.venv/bin/spindle verify ", CHECK, "up to 6 processes, 15-25 s: libs/engine/tests run these plans"),
    Rule(r"^\.venv/bin/python bench/bench_engine\.py .*--repeats 1 ", SLOW, "the benchmark's quick check: ~9 s"),
    Rule(r"^\.venv/bin/python bench/bench_peer\.py --(?!help)", CHECK, "vLLM and Spindle servers: minutes"),
    Rule(r"^\.venv/bin/python bench/\w+\.py --smoke\b", SLOW, "a GPU benchmark's tiny CPU run: a few seconds"),
    Rule(r"^\.venv/bin/python -m spindle_transfer\.testing$", SLOW, "2 gloo ranks: about 5 s"),
    Rule(r"^\.venv/bin/python bench/\w+\.py\b", CHECK, "a benchmark: minutes, or a stack"),
    Rule(r"^(PYTHONPATH=\S+ )?python3? bench/\w+_gpu\.py\b", GPU, "needs CUDA"),
    Rule(r"^\.venv/bin/spindle (sim sweep|profile|up) ", CHECK, "sweep ~20 s, profile minutes, up blocks"),
    Rule(r"^\.venv/bin/python -m spindle_\w+ --", CHECK, "a service: needs nats-server and the stack"),
    Rule(r"^\.venv/bin/python -m pytest ", CHECK, "a test suite: `make test` runs it"),
    Rule(r"^make ", CHECK, "serve blocks, test runs the whole suite, bench-* take minutes"),
    Rule(r"^curl ", CHECK, "needs a running `make serve`"),
    Rule(r"^docker ", CHECK, "needs a Docker engine"),
)

HOW_TO_CLASSIFY = (
    "add a Rule to RULES in tests/test_readme.py (or widen one): RUN if it takes a few seconds and loads no "
    "model, SLOW if it loads the model or starts processes and takes under ~30 s, CHECK if it serves, "
    "benchmarks, needs a running stack or takes longer (then its executable, files and flags are checked), "
    "GPU if it needs CUDA"
)

OUTPUT_FLAGS = {"--out", "--json", "--plot", "--profile-out", "--log-dir"}
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1"}
PATH_LIKE = re.compile(r"[\w.\-/]+")
FILE_SUFFIX = re.compile(r"\.(txt|json|jsonl|csv|gguf|py|ya?ml|conf|toml|png|md)$")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")


# --- the READMEs ------------------------------------------------------------------------------------------------


def readme_files() -> list[Path]:
    found = {ROOT / "README.md", *ROOT.glob("*/README.md"), *ROOT.glob("*/*/README.md"), *ROOT.glob("docs/**/*.md")}
    skip = {"build", "dist", "node_modules"}
    return sorted(
        p
        for p in found
        if not any(
            part.startswith(".") or part in skip or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts
        )
    )


@dataclass(frozen=True)
class Block:
    readme: str
    line: int  # of the opening fence
    lang: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Command:
    readme: str  # relative to ROOT
    line: int
    source: str  # as the README shows it (continuation lines included)
    argv: tuple[str, ...]  # its words, comments dropped
    inline: bool = False
    earlier_outputs: frozenset[str] = field(default=frozenset(), compare=False)
    error: str = ""

    @property
    def where(self) -> str:
        return f"{self.readme}:{self.line}"

    @property
    def text(self) -> str:
        return " ".join(self.argv)


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<lang>[^`\s]*)[^`]*$")


def parse_readme(path: Path) -> tuple[list[Block], str]:
    """Fenced blocks, and the text outside them (block lines blanked, so offsets keep their line numbers)."""
    blocks: list[Block] = []
    prose: list[str] = []
    rel = str(path.relative_to(ROOT))
    open_fence: tuple[int, str, str, str] | None = None  # line, indent, fence, lang
    body: list[str] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if open_fence is None:
            m = FENCE.match(line)
            if m:
                open_fence, body = (n, m["indent"], m["fence"], m["lang"].lower()), []
                prose.append("")
            else:
                prose.append(line)
            continue
        prose.append("")
        start, indent, fence, lang = open_fence
        stripped = line.strip()
        if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            blocks.append(Block(rel, start, lang, tuple(body)))
            open_fence = None
        else:
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
    if open_fence is not None:
        blocks.append(Block(rel, open_fence[0], "<unclosed>", tuple(body)))
    return blocks, "\n".join(prose)


def block_commands(block: Block) -> list[Command]:
    """A shell block's commands: backslash-continued lines and quotes that span lines joined."""
    out: list[Command] = []
    buf: list[str] = []
    start = 0
    for i, line in enumerate(block.lines):
        if not buf:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = block.line + 1 + i
        buf.append(line)
        if line.rstrip().endswith("\\"):
            continue
        source = "\n".join(buf)
        try:
            argv = shlex.split(re.sub(r"\\\n", " ", source), comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        out.append(Command(block.readme, start, source, tuple(argv)))
        buf = []
    if buf:
        out.append(Command(block.readme, start, "\n".join(buf), (), error="the block ends inside this command"))
    return out


INLINE_EXES = {"make", "spindle", "python", "python3", "pytest"}


def inline_commands(readme: str, prose: str) -> list[Command]:
    out, seen = [], set()
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(m.group(1).split())
        try:
            argv = shlex.split(span)
        except ValueError:
            continue
        words = split_env(argv)[1]
        if len(words) < 2 or span in seen:
            continue
        exe = words[0]
        if exe in INLINE_EXES or exe.startswith(".venv/bin/") or re.fullmatch(r"bench/\w+\.py", exe):
            seen.add(span)
            line = prose.count("\n", 0, m.start()) + 1
            out.append(Command(readme, line, span, tuple(argv), inline=True))
    return out


def outputs_of(argv: tuple[str, ...]) -> set[str]:
    return {value for value, is_output in arg_values(argv) if is_output}


def collect() -> tuple[list[Block], list[Command], list[Command]]:
    blocks, commands, inline = [], [], []
    for path in readme_files():
        file_blocks, prose = parse_readme(path)
        blocks += file_blocks
        produced: set[str] = set()
        for block in file_blocks:
            if block.lang not in SHELL_LANGS:
                continue
            for cmd in block_commands(block):
                commands.append(replace(cmd, earlier_outputs=frozenset(produced)))
                produced |= outputs_of(cmd.argv)
        rel, all_outputs = str(path.relative_to(ROOT)), frozenset(produced)
        inline += [replace(c, earlier_outputs=all_outputs) for c in inline_commands(rel, prose)]
    return blocks, commands, inline


def classify(cmd: Command) -> Rule | None:
    return next((rule for rule in RULES if re.search(rule.pattern, cmd.text)), None) if cmd.argv else None


# --- checks -----------------------------------------------------------------------------------------------------


def split_env(argv: tuple[str, ...] | list[str]) -> tuple[dict[str, str], list[str]]:
    env, words = {}, list(argv)
    while words and ENV_ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def arg_values(argv: tuple[str, ...] | list[str]) -> Iterator[tuple[str, bool]]:
    """(value, is it an output) for every option value and positional argument."""
    prev = ""
    for tok in split_env(argv)[1][1:]:
        if tok.startswith("-"):
            name, eq, value = tok.partition("=")
            if eq:
                yield value, name in OUTPUT_FLAGS
            prev = name
            continue
        yield tok, prev in OUTPUT_FLAGS
        prev = ""


def path_like(tok: str) -> bool:
    return bool(PATH_LIKE.fullmatch(tok)) and ("/" in tok or bool(FILE_SUFFIX.search(tok))) and "..." not in tok


def clean_env() -> dict[str, str]:
    """The environment of a fresh shell after `make test`: the venv is not on the PATH."""
    env = dict(os.environ)
    venv_bin = (ROOT / ".venv" / "bin").resolve()
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != venv_bin
    )
    for name in ("VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL", "PYTHONHOME"):
        env.pop(name, None)
    return env


def run(argv: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """argv in its own process group (what it starts dies with it on a timeout); exit status and output."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, (out or "") + f"\n[killed after {timeout:.0f} s]"
    return proc.returncode, out


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


@functools.cache
def help_text(prefix: tuple[str, ...]) -> tuple[int, str]:
    return run([*prefix, "--help"], ROOT, HELP_TIMEOUT_S)


@functools.cache
def makefile() -> str:
    return (ROOT / "Makefile").read_text()


def serve_default(flag: str) -> str:
    """A flag's value in the Makefile's default SERVE_ARGS (what `make serve` starts)."""
    args = re.search(r"^SERVE_ARGS\s*\??=(.*)$", makefile(), re.M)
    assert args, "the Makefile sets no SERVE_ARGS"
    m = re.search(rf"{flag}[ =](\S+)", args.group(1))
    assert m, f"the Makefile's SERVE_ARGS set no {flag}"
    return m.group(1)


def resolve_cli(words: list[str], bare_ok: bool) -> tuple[list[str], list[str], list[str]]:
    """(the command's prefix that takes --help, the remaining arguments, problems)."""
    exe, rest = words[0], words[1:]
    problems: list[str] = []
    if exe in ("spindle", "python", "python3", "pytest"):
        venv_exe = ".venv/bin/" + ("python" if exe.startswith("python") else exe)
        if not bare_ok:
            problems.append(f"`{exe}` is not on the PATH after `make test`: write `{venv_exe}`")
        exe = venv_exe
    elif re.fullmatch(r"bench/\w+\.py", exe):
        exe, rest = ".venv/bin/python", [exe, *rest]
    elif not exe.startswith(".venv/bin/"):
        return [], rest, [f"no checker for the executable `{exe}`: teach tests/test_readme.py about it"]
    if not os.access(ROOT / exe, os.X_OK):
        return [], rest, [*problems, f"`{exe}` does not exist after `make install`"]
    prefix = [exe]
    if exe.endswith("/python"):
        if rest[:1] == ["-m"] and len(rest) > 1:
            module = rest[1]
            if "<" in module:  # a placeholder: python -m spindle_<service>
                return [], [], problems
            if importlib.util.find_spec(module) is None:
                return [], [], [*problems, f"no module `{module}` in the venv"]
            prefix, rest = [exe, "-m", module], rest[2:]
        elif rest and not rest[0].startswith("-"):
            if not (ROOT / rest[0]).is_file():
                return [], [], [*problems, f"no script `{rest[0]}` in the repository"]
            prefix, rest = [exe, rest[0]], rest[1:]
        else:
            return [], [], problems  # python -c ... or a bare interpreter: nothing to check
    elif exe.endswith("/spindle"):
        while rest and not rest[0].startswith("-"):  # sub-commands: spindle sim sweep ...
            prefix.append(rest.pop(0))
    return prefix, rest, problems


def long_flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def check_cli(cmd: Command, words: list[str], kind: str) -> list[str]:
    prefix, rest, problems = resolve_cli(words, bare_ok=cmd.inline or kind == GPU)
    if not prefix:
        return problems
    flags = long_flags(rest)
    if kind == RUN and not cmd.inline:
        return problems  # running it checks the rest
    if not flags and not (prefix[0].endswith("/spindle") and len(prefix) > 1):
        return problems  # nothing --help could tell (a sub-command must be in it)
    if flags and not cmd.inline and kind in (CHECK, GPU):
        # the whole line through the command's own parser (values, choices); --help last makes it exit 0 there
        rc, out = run([*prefix, *rest, "--help"], ROOT, HELP_TIMEOUT_S)
        if rc != 0:
            refused = f"`{' '.join(prefix)}` refuses these arguments (exit {rc}):\n{tail(out, 8)}"
            rc, out = help_text(tuple(prefix))
            problems.append(refused if rc == 0 else "")
    else:
        rc, out = help_text(tuple(prefix))
    problems = [p for p in problems if p]
    if rc != 0:
        return [*problems, f"`{' '.join(prefix)} --help` fails (exit {rc}):\n{tail(out, 8)}"]
    for flag in flags:
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out):
            problems.append(f"`{' '.join(prefix)}` has no {flag} (not in its --help)")
    return problems


def check_files(cmd: Command) -> list[str]:
    problems = []
    for value, is_output in arg_values(cmd.argv):
        if not path_like(value):
            continue
        if is_output:
            parent = Path(value).parent if Path(value).is_absolute() else ROOT / Path(value).parent
            if not parent.is_dir():
                problems.append(f"output `{value}`: no directory {parent}")
        elif value not in cmd.earlier_outputs and not (ROOT / value).exists():  # ROOT / an absolute path = it
            problems.append(f"`{value}` is neither in the repository nor written by an earlier command of {cmd.readme}")
    env, _ = split_env(cmd.argv)
    for name, value in env.items():
        if name == "PYTHONPATH" and value != "...":
            problems += [f"PYTHONPATH: no directory {d}" for d in value.split(":") if not (ROOT / d).is_dir()]
    return problems


def check_make(cmd: Command, args: list[str]) -> list[str]:
    return list(make_problems(tuple(args)))


@functools.cache
def make_problems(args: tuple[str, ...]) -> tuple[str, ...]:
    problems = []
    for arg in args:
        name, eq, _ = arg.partition("=")
        if eq and not re.search(rf"^{re.escape(name)}\s*[?:+]?=", makefile(), re.M):
            problems.append(f"the Makefile has no variable {name}")
    rc, out = run(["make", "-n", "--no-print-directory", *args], ROOT, HELP_TIMEOUT_S)
    if rc != 0:
        return (*problems, f"`make -n {shlex.join(args)}` fails (exit {rc}):\n{tail(out, 8)}")
    for line in out.splitlines():  # what the recipe runs: Spindle's own commands are checked like the README's
        if line.startswith((".venv/bin/spindle ", ".venv/bin/python bench/")):
            recipe = Command("Makefile", 0, line, tuple(shlex.split(line)))
            problems += [f"its recipe runs `{line}`: {p}" for p in check_cli(recipe, list(recipe.argv), CHECK)]
    return tuple(problems)


def check_docker(cmd: Command, args: list[str]) -> list[str]:
    problems = check_files(cmd)
    if args[:1] == ["build"] and not (ROOT / args[-1]).is_dir():
        problems.append(f"docker build context `{args[-1]}` is not a directory")
    return problems


@functools.cache
def gateway_routes() -> list:
    """The gateway app's routes; the app is built around a stand-in state (no tokenizer, no NATS)."""
    from spindle_gateway.app import create_app
    from spindle_gateway.batch.store import BatchStore

    config = SimpleNamespace(body_limit=1 << 22, served_model_name="smollm2", model="smollm2",
                             batch_max_file_bytes=1 << 20, batch_max_lines=10, batch_concurrency=1)  # fmt: skip
    store = BatchStore(Path(tempfile.mkdtemp(prefix="spindle-readme-")) / "batches.sqlite")
    state = SimpleNamespace(
        metrics=SimpleNamespace(error=lambda *a, **k: None), config=config, batches=store, dashboard=None
    )
    return list(create_app(state).routes)


def check_curl(cmd: Command, args: list[str]) -> list[str]:
    from spindle_gateway import schemas
    from spindle_gateway.errors import GatewayError

    url, method, body, problems = "", "", None, []
    it = iter(args)
    for tok in it:
        if tok in ("-d", "--data", "--data-raw", "--data-binary", "--json"):
            body = next(it, "")
        elif tok in ("-X", "--request"):
            method = next(it, "")
        elif tok in ("-H", "--header"):
            next(it, "")
        elif tok.startswith(("http://", "https://")):
            url = tok
        elif tok not in ("-s", "-S", "-sS", "--silent", "-N", "--no-buffer", "-i", "-v", "--fail", "-f"):
            problems.append(f"curl option {tok}: teach check_curl in tests/test_readme.py about it")
    method = method or ("POST" if body is not None else "GET")
    parts = urlsplit(url)
    if not url:
        return [*problems, "no URL"]
    if parts.hostname not in ("127.0.0.1", "localhost") or str(parts.port) != serve_default("--port"):
        problems.append(f"{url}: `make serve` listens on 127.0.0.1:{serve_default('--port')}")
    routes = [r for r in gateway_routes() if r.path_regex.match(parts.path) and method in (r.methods or ())]
    if not routes:
        problems.append(f"the gateway has no {method} {parts.path}")
    models = {"/v1/chat/completions": schemas.ChatCompletionRequest, "/v1/completions": schemas.CompletionRequest}
    if body is None:
        return problems
    try:
        obj = json.loads(body)
    except ValueError as e:
        return [*problems, f"the body is not JSON: {e}"]
    model = models.get(parts.path)
    if model is None or not isinstance(obj, dict):
        return problems
    unknown = sorted(set(obj) - set(model.model_fields))
    if unknown:
        problems.append(f"{model.__name__} has no field {', '.join(unknown)} (the gateway would ignore it)")
    try:
        req = schemas.parse_body(body.encode(), model)
        schemas.check_common(req, vocab_size=1 << 31)  # refuses unsupported fields, checks ranges
        if model is schemas.ChatCompletionRequest:
            schemas.chat_messages(req)
    except GatewayError as e:
        problems.append(f"the gateway answers {e.status}: {e.message}")
    if obj.get("model") not in (None, serve_default("--model")):
        problems.append(f"model {obj.get('model')!r}: `make serve` serves {serve_default('--model')!r}")
    return problems


def check_command(cmd: Command, kind: str) -> list[str]:
    if cmd.error:
        return [cmd.error]
    words = split_env(cmd.argv)[1]
    if set(words) & SHELL_OPERATORS:
        return ["shell operators (pipes, &&, redirections): write one command per line, or teach this test"]
    exe, args = words[0], words[1:]
    if exe == "make":
        return check_make(cmd, args)
    if exe == "curl":
        return check_curl(cmd, args)
    if exe == "docker":
        return check_docker(cmd, args)
    return check_files(cmd) + check_cli(cmd, words, kind)


BLOCKS, COMMANDS, INLINE = collect()


# --- tests ------------------------------------------------------------------------------------------------------


def test_the_readme_is_a_front_door() -> None:
    """At most 200 lines, the two commands in its first screen, and the rest in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail to docs/"
    first_screen = "\n".join(lines[:60])
    assert "make serve" in first_screen and "make test" in first_screen
    assert (ROOT / "docs" / "README.md").exists()


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", readme_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_doc_links_stay_in_the_repository(doc: Path) -> None:
    """Every relative link of a user doc names a file or folder of the checkout (none leaves it), and no doc points
    readers at an issue tracker or numbered work periods they cannot see from a clone."""
    text = doc.read_text()
    for target in LINK.findall(text):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.relative_to(ROOT)}: link {target} leaves the repository"
        assert path.exists(), f"{doc.relative_to(ROOT)}: link {target} names nothing"
    found = re.findall(r"\b(?:issue|session|stop) #?\d+\b", text, flags=re.IGNORECASE)
    assert not found, f"{doc.relative_to(ROOT)} refers to {found}"


def test_the_readmes_have_shell_examples() -> None:
    assert any(c.readme == "README.md" for c in COMMANDS), "no ```bash command found in README.md"
    assert any(classify(c) and classify(c).kind == SLOW for c in COMMANDS)


def test_every_readme_command_is_classified() -> None:
    problems = []
    for block in BLOCKS:
        if not block.lang or block.lang == "<unclosed>":
            problems.append(
                f"{block.readme}:{block.line}: a fenced block "
                + ("that never closes" if block.lang else "without a language")
                + ": label it ```bash if it shows commands to run (tests/test_readme.py then runs or checks"
                " each), else ```text (or python, json, ...)"
            )
    for cmd in COMMANDS:
        if cmd.error:
            problems.append(f"{cmd.where}: {cmd.error}: {cmd.source!r}")
        elif classify(cmd) is None:
            problems.append(f"{cmd.where}: `{cmd.text}` matches no rule: {HOW_TO_CLASSIFY}")
    assert not problems, "\n".join(problems)


def _id(cmd: Command) -> str:
    return f"{cmd.where}:{cmd.argv[0] if cmd.argv else ''}"


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if classify(c)], ids=_id)
def test_readme_command_is_sound(cmd: Command) -> None:
    """Executable, files, make targets, flags (and curl bodies) of every command, run or not."""
    rule = classify(cmd)
    assert rule is not None
    problems = check_command(cmd, rule.kind)
    assert not problems, f"{cmd.where}: `{cmd.source}`\n" + "\n".join(f"- {p}" for p in problems)


@pytest.mark.parametrize("cmd", INLINE, ids=_id)
def test_inline_command_is_sound(cmd: Command) -> None:
    """Commands quoted in the text exist and name only flags they have (values may be placeholders)."""
    problems = check_command(cmd, CHECK)
    assert not problems, f"{cmd.where}: `{cmd.source}`\n" + "\n".join(f"- {p}" for p in problems)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch repository root: links to the checkout's entries, but bench/ is a copy with an empty results/
    (a benchmark's default output lands here), and the commands' relative outputs (out.json) land here too."""
    root = tmp_path_factory.mktemp("readme-root")
    for entry in ROOT.iterdir():
        if entry.name != "bench":
            (root / entry.name).symlink_to(entry)
    (root / "bench" / "results").mkdir(parents=True)
    for f in (ROOT / "bench").iterdir():
        if f.is_file():
            shutil.copy2(f, root / "bench" / f.name)
    return root


def _runs() -> list:
    params = []
    for cmd in COMMANDS:
        rule = classify(cmd)
        if rule and rule.kind in (RUN, SLOW):
            marks = [pytest.mark.slow] if rule.kind == SLOW else []
            params.append(pytest.param(cmd, marks=marks, id=_id(cmd)))
    return params


@pytest.mark.parametrize("cmd", _runs())
def test_readme_command_runs(cmd: Command, workdir: Path) -> None:
    """The command as the README shows it, run by bash from the repository root: it exits 0."""
    rc, out = run(["bash", "-c", cmd.source], workdir, RUN_TIMEOUT_S)
    assert rc == 0, f"{cmd.where}: `{cmd.source}` exited {rc}:\n{tail(out)}"
    assert out.strip(), f"{cmd.where}: `{cmd.source}` printed nothing"
