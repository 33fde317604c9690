"""The package's import graph, read from the source (nothing is imported): the commands in
cli/ sit on top, so no module below them imports them, and no two modules import each other,
even through others or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "personaplex_cli"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its text (a function's lazy
    import counts too): `from .a import b` names a.b where b is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules
                       else origin for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_graph_is_read():
    graph = _graph()
    assert f"{PACKAGE}.core.slots" in graph[f"{PACKAGE}.conversation"]
    assert f"{PACKAGE}.outputs" in graph[f"{PACKAGE}.batch"]


def test_no_module_below_cli_imports_cli():
    commands = f"{PACKAGE}.cli"
    below = {name for name in _graph() if name != f"{PACKAGE}.__main__"
             and name != commands and not name.startswith(commands + ".")}
    graph = _graph()
    upward = sorted(f"{name} -> {target}" for name in below for target in graph[name]
                    if target == commands or target.startswith(commands + "."))
    assert upward == []


def test_no_import_cycle():
    graph = _graph()
    cycles, state, path = [], {}, []

    def visit(name: str) -> None:
        state[name] = "open"
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert cycles == []


def _definitions() -> dict[str, list[str]]:
    """Module-level classes, functions and UPPER_CASE constants -> the modules defining them."""
    found: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found.setdefault(node.name, []).append(name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id.isupper():
                        found.setdefault(target.id, []).append(name)
    return found


def test_no_second_class_of_a_name():
    """A reader never asks which `Session`, `Slots` or `Engine` is meant."""
    classes: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(name)
    assert {name: homes for name, homes in classes.items() if len(homes) > 1} == {}


# Decisions every command shares, each with one home: the frame length, the silence level
# and its measure, the caller queue depth, the speaker buffer, the persona cache, the
# precision and quantization names, the conversation window, the speaking level (talk's view
# and serve's voice activity), the model names OpenAI's routes answer to.
SHARED_DECISIONS = {
    "FRAME_MS": "core.config", "SILENCE_DBFS": "audio.level", "dbfs": "audio.level",
    "SPEAKING_DBFS": "audio.level", "MODEL_IDS": "serve.openai_models",
    "CALLER_QUEUE_FRAMES": "runtime.limits", "SPEAKER_BUFFER_MS": "runtime.limits",
    "PERSONAS_CACHED": "core.config", "DTYPE_NAMES": "core.config",
    "QUANTIZE_MODES": "core.config", "CONVERSATION_WINDOW": "core.config",
    "PRIMER_ROWS": "core.config", "primer_rows": "core.config", "MAX_PRIME_S": "runtime.limits",
    "role_prompt_refusal": "runtime.limits",
}


def test_each_shared_decision_has_one_home():
    defined = _definitions()
    homes = {name: defined.get(name, []) for name in SHARED_DECISIONS}
    assert homes == {name: [f"{PACKAGE}.{home}"] for name, home in SHARED_DECISIONS.items()}


# The engine's rows are stepped and primed by the runtime alone (runtime/scheduler.py);
# below it, ConversationBatch wraps core's Slots, and doctor's bench times core's Slots bare.
ENGINE_CALLS = {"step", "prime"}
STEPPED_OUTSIDE_THE_RUNTIME = {
    ("conversation", "self.engine.step"), ("conversation", "self.engine.prime"),
    ("conversation", "self.prime"),  # ConversationBatch.join: begin, then prime to the end
    ("doctor.bench", "slots.step"),
    # the agreement check steps the engine's Session itself, teacher-forced, as no command does
    ("doctor.agree", "slots.session.step"),
}


def test_only_the_runtime_steps_the_engine():
    """No command, server or loop steps or primes a ConversationBatch itself: reply (and the
    Ray workers), talk and serve submit rows to runtime.scheduler, which does."""
    found = set()
    for name, path in _modules().items():
        short = name.removeprefix(f"{PACKAGE}.")
        if short.startswith(("runtime.", "core.")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ENGINE_CALLS:
                found.add((short, ast.unparse(node.func)))
    assert found == STEPPED_OUTSIDE_THE_RUNTIME


def test_every_command_runs_on_the_one_scheduler():
    graph = _graph()
    scheduler = f"{PACKAGE}.runtime.scheduler"
    for user in ("batch", "serve.switchboard", "live.loop", "cli.persona"):
        assert scheduler in graph[f"{PACKAGE}.{user}"], user
    assert scheduler not in graph[f"{PACKAGE}.conversation"]  # personas, nothing that schedules
