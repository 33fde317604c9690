"""The package's import graph, read from the source (nothing is imported): the rooms stand on
floors (core at the bottom, then the codecs and files, the model, the personas, the live
audio, the runtime, what serves and answers, the commands), no import runs up a floor, and no
two modules import each other, even through others or inside a function. One runtime: every
command opens it by `runtime.open`, and only it steps the session, warms up or sizes a run."""

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
    assert f"{PACKAGE}.runtime.priming" in graph[f"{PACKAGE}.runtime.scheduler"]
    assert f"{PACKAGE}.outputs" in graph[f"{PACKAGE}.batch"]


# The floors, from the ground up: a module imports only from its own floor or below.
FLOORS = [
    {"", "core", "errors", "clib", "streams", "histogram"},
    {"audio", "codes", "codec", "transcript"},
    {"model", "outputs", "manifest"},
    {"prompts"},
    {"live"},
    {"runtime"},
    {"batch", "serve"},
    {"doctor", "cluster"},
    {"cli"},
    {"__main__"},
]


def _floor(module: str) -> int:
    room = module.removeprefix(PACKAGE).lstrip(".").split(".")[0]
    return next(level for level, rooms in enumerate(FLOORS) if room in rooms)


def test_no_import_runs_up_a_floor():
    """Nothing below the runtime imports it (live/, model/, prompts/ and core/ know no
    scheduler), and nothing imports from a floor above its own."""
    graph = _graph()
    upward = sorted(f"{name} -> {target}" for name, targets in graph.items()
                    for target in targets if _floor(target) > _floor(name))
    assert upward == []


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
    "CALLER_QUEUE_FRAMES": "live.jitter", "ASSISTANT_QUEUE_MS": "live.jitter",
    "OUTPUT_QUEUE_FRAMES": "serve.call", "MOST_SESSIONS": "runtime.limits",
    "REAL_TIME_SHARE": "runtime.warmup", "SKIPPED_FRAMES": "runtime.warmup",
    "Personas": "runtime.personas", "RowState": "runtime.rows", "Histogram": "histogram",
    "DEFAULT_ROLE": "model.tokenizer", "not_utf8": "model.tokenizer", "PACKAGED": "model.files",
    "graphed_or_eager": "core.graphs",
    "PERSONAS_CACHED": "core.config", "DTYPE_NAMES": "core.config",
    "QUANTIZE_MODES": "core.config", "CONVERSATION_WINDOW": "core.config",
    "PRIMER_ROWS": "core.config", "primer_rows": "core.config", "MAX_PRIME_S": "runtime.limits",
    "role_prompt_refusal": "runtime.limits",
}


def test_each_shared_decision_has_one_home():
    defined = _definitions()
    homes = {name: defined.get(name, []) for name in SHARED_DECISIONS}
    assert homes == {name: [f"{PACKAGE}.{home}"] for name, home in SHARED_DECISIONS.items()}


# The session's rows are stepped and primed by the runtime alone (runtime/scheduler.py);
# doctor's agreement check steps a scheduler bare, teacher-forced, as no command does.
ENGINE_CALLS = {"step", "prime"}
STEPPED_OUTSIDE_THE_RUNTIME = {("doctor.agree", "scheduler.step")}


def test_only_the_runtime_steps_the_engine():
    """No command, server or loop steps or primes the session itself: reply (and the Ray
    workers), talk and serve submit rows to runtime.scheduler, which does."""
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


# What only runtime.open decides: the memory check, the thread count, the rows that keep real
# time, CUDA graphs or not. model/ and core/ define the arithmetic it asks for.
WARM_UP = {"decide_threads", "time_steps", "warm_up_slots", "warm_up_row", "settle",
           "apply_remembered", "preflight", "sessions_that_fit", "use_graphs", "check_fits"}
# doctor's random-weights model answers the runtime's memory questions as model.Model does;
# its agreement check asks whether the device has graphs to compare with eager at all.
DECIDED_OUTSIDE_THE_RUNTIME = {("doctor.bench", "check_fits"),
                               ("doctor.bench", "sessions_that_fit"),
                               ("doctor.agree", "use_graphs")}


def test_every_command_opens_the_one_runtime():
    """serve (and each Ray replica through it), talk, reply, the Ray workers and doctor
    --bench open the runtime by `runtime.open`; none of them checks memory, decides threads
    or real time, or captures graphs itself."""
    openers = set()
    decided = set()
    for name, path in _modules().items():
        short = name.removeprefix(f"{PACKAGE}.")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "runtime" and \
                    any(alias.name == "open" for alias in node.names):
                openers.add(short)
            if isinstance(node, ast.Call) and not short.startswith(("runtime", "model",
                                                                      "core")):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(
                    func, "id", None)
                if called in WARM_UP:
                    decided.add((short, called))
    assert openers == {"serve.server", "cli.talk", "cli.reply", "cluster.replies",
                       "doctor.bench"}
    assert decided == DECIDED_OUTSIDE_THE_RUNTIME


def test_bench_readme_names_every_bench_script():
    """bench/README.md says what each script measures and where its figure is quoted: a
    script it does not name is one nobody can find (depformer.py was missing)."""
    bench = ROOT.parent / "bench"
    listed = (bench / "README.md").read_text()
    scripts = [path.relative_to(bench).as_posix() for path in sorted(bench.rglob("*.py"))
               if not path.name.startswith("_")]
    missing = [name for name in scripts if f"`{name}`" not in listed]
    assert scripts and not missing, f"bench/README.md does not name {missing}"
