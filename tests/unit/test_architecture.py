"""The layout rules of the code (README.md, "Stages, and where their code is"), checked on the source (parsed with `ast`;
the list of stages is the registry's, eagle3_pipeline/pipeline/registry.py, which imports the stage modules):
  - the core (src/eagle3_pipeline) never imports Prefect, not even inside a function;
  - the import direction is flows -> tasks -> eagle3_pipeline: tasks/ never imports flows/;
  - one place builds a vLLM engine: nothing but src/eagle3_pipeline/engine/build.py constructs `vllm.LLM`
    (src/ and bench/ are checked);
  - one shape per stage: a stage's child is `<stage>/worker.py`, never a top-level `*_worker.py`;
    each stage package has `stage.py` (the glue the flow calls) and an `__init__.py` of at most 60 lines;
  - layers: the ground floor (the rooms core, records, data, engine, checks, tiny, targets) never imports a
    stage package (STAGES), and a stage package never imports a sibling stage package, prepare included (its
    dataset reader is data/tokenized.py); shared pieces live on the ground floor; nothing below the pipeline
    room (ABOVE_STAGES) imports it;
  - floors: the package root holds folders only (and __init__.py), each a room (FLOORS), a stage (the registry's)
    or the pipeline room above them, and a room imports only rooms on the floors below it;
  - no private name (`_x`) is imported across a module line (the core, flows/, tasks/);
  - the stage interface: every registered stage declares `STAGE = StageSpec(...)` (core/stage_spec.py) that
    matches it (entry, record, error, worker), its entry is called by the pipeline, and a stage that holds
    accelerators runs under a GPU slot in tasks/; the lists below the registry that name stages (the report's
    entries, core/cluster.py's GPU Jobs) are the registry's;
  - no function in the core takes more than 6 parameters (self/cls not counted), but the listed ones;
  - no function is over 60 lines but the listed ones, at most 6 and none over 80 (the core, flows/, tasks/).
Each checker takes source text, so each rule is also shown to fail on a small synthetic violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eagle3_pipeline.pipeline import registry

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "src" / "eagle3_pipeline"
ENGINE = CORE / "engine" / "build.py"


def _sources(*dirs: Path) -> dict[Path, str]:
    found = {p: p.read_text() for d in dirs for p in sorted(d.rglob("*.py"))}
    assert found, f"no Python files under {dirs}"
    return found


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import anywhere in `source` (module level, functions,
    classes, conditionals): `import a.b` gives a.b; `from a.b import c` gives a.b and a.b.c."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def imports_of(source: str, package: str) -> list[str]:
    """`line N: module` for each import of `package` or one of its submodules."""
    return sorted({f"line {n}: {m}" for n, m in imported_modules(source) if m == package or m.startswith(package + ".")})


def llm_constructions(source: str) -> list[str]:
    """`line N: call` for each call that constructs vLLM's `LLM`: `LLM(...)` (also under an alias
    imported from vllm) and `<module>.LLM(...)` (`vllm.LLM(...)`, `import vllm as v; v.LLM(...)`)."""
    tree = ast.parse(source)
    names = {"LLM"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            names |= {a.asname or a.name for a in node.names if a.name == "LLM"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id in names) or (isinstance(f, ast.Attribute) and f.attr == "LLM"):
                found.append(f"line {node.lineno}: {ast.unparse(f)}(...)")
    return found


def private_imports(source: str) -> list[str]:
    """`line N: module.name` for each `from <ours> import _name`: a private name taken across a module line
    (ours: eagle3_pipeline, flows, tasks)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] in ("eagle3_pipeline", "flows", "tasks"):
            out += [f"line {node.lineno}: {node.module}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def top_level_workers(package_dir: Path) -> list[str]:
    return sorted(p.name for p in Path(package_dir).glob("*_worker.py"))


# The stage packages: the registered stages (eagle3_pipeline.pipeline.registry.STAGES, which imports every stage
# module and no Prefect), each a package of its own with its STAGE in <name>/stage.py.
REGISTERED = {s.name: s for s in registry.STAGES}
STAGES = tuple(REGISTERED)
# The ground floor's rooms, floor by floor: a room imports its own modules and rooms on the floors below,
# never a room beside or above it; the stage packages and ABOVE_STAGES stand on all of them.
FLOORS = (("core",), ("records", "data"), ("engine", "checks", "tiny"), ("targets",))
ROOMS = {room: n for n, floor in enumerate(FLOORS) for room in floor}
# The room above the stages, and why each of its modules must import them.
ABOVE_STAGES = "pipeline"
PIPELINE_MODULES = {
    "__init__.py": "the room's map",
    "registry.py": "the one ordered list of the stages' StageSpecs: it reads every stage's STAGE",
    "stages.py": "every stage's one way in (run_stage) and what a stage needs from a sibling (NEEDS)",
    "store_gc.py": "gc sweeps what every stage keeps (versions, the record pool, the pool's verify caches)",
    "online_training.py": "online training runs the verify gate on rows from the server the trainer then reads",
    "window_training.py": "window training runs extract and verify per shard beside the trainer reading the window",
    "jobs.py": "the Kubernetes Job of each stage that runs as its own: the registry's JOB_STAGES",
    "engine_sets.py": "an engine stage's Job (jobs.py) over several nodes: the engine set's Kubernetes objects",
}
# Stage packages whose glue is not yet called stage.py: the list can only shrink.
NO_STAGE_PY: dict[str, str] = {}
INIT_MAX_LINES = 60
MAX_PARAMS = 6
# Functions over MAX_PARAMS parameters today, "path:function" -> why; the list can only shrink.
PARAM_EXCEPTIONS = {
    "engine/build.py:server_argv": "the vLLM server's command line from engine settings, layers, connector and paths",
    "evaluate/prompts.py:load_prompt_set": "public reader: source, tokenizer, template and selection knobs; a typed request next",
    "evaluate/stage.py:evaluate_draft": "public API (tests, eagle3 evaluate): cfg, target, draft, prompts, dir, log, label",
    "evaluate/stage.py:evaluate_pair": "public API called by stages.py and tests; the drafts belong in one typed record",
    "evaluate/stage.py:_evaluate_pair": "evaluate_pair's body under the dir lock; shrinks with evaluate_pair",
    "extract/stage.py:extract_group": "public API (flows, tasks, tests): settings, target, version, shards, log, force, progress",
    "core/proc.py:run_child": "the one child runner: its keyword options (deadline, log, callbacks, env) are its interface",
    "core/proc.py:_spawn": "run_child's process start; takes run_child's options",
    "report/stage.py:build_report": "one record per stage result; a typed run record next",
    "pipeline/stages.py:stage_evaluate": "the glue takes the earlier stages' records one by one, as the flow holds them",
    "tiny/build_cache.py:cached_build": "tiny/ keys the kept builds: changing it forces a rebuild",
    "tiny/training.py:train_lm": "tiny/ keys the kept builds: changing it forces a rebuild",
    "train/online.py:__init__": "HiddenStateServer: the server's engine settings, version, work dir, deadlines, log",
    "train/stage.py:train_draft": "public API (stages.py, bench, tests); the inputs belong in one typed record",
    "train/stage.py:_train_draft": "train_draft's body under the dir lock; shrinks with train_draft",
    "train/stage.py:make_untrained_draft": "public API (stages.py, tests); shrinks with train_draft",
    "verify/reference.py:stream_reference": "the reference child's inputs: target, version, rows, budget, work dir, log",
}


MAX_LINES = 60
MAX_LISTED_LINES = 80  # no function over this, listed or not
MAX_LISTED = 6  # at most this many functions over MAX_LINES
# Functions over MAX_LINES lines today, "path:function" -> (its length cap, why), in one line; a cap is the
# function's length when it was listed, and caps only go down: the list can only shrink. Core, flows/, tasks/.
LONG_FUNCTIONS = {
    "prepare/stage.py:_encode_chunk": (79, "one pass per row: render, tokenize, mask, trim and quarantine, counting each reason"),
    "preflight/stage.py:preflight": (80, "the checks in the order a user reads them; each adds a problem or a warning"),
    "targets/smollm2.py:build_smollm2": (66, "GGUF tensors to HF names, tokenizer and template, written in the build's order"),
    "train/export.py:export_check": (79, "one check per property of an exported draft, each with its own message"),
    "verify/scan.py:_read_record": (71, "one record's read with a problem message for every way a file can be wrong"),
}


MAX_DOC_LINES = 12  # a module's docstring: what it is in a few lines; how and why in docs/ (docs/internals.md)
# Where a longer docstring stays for now, by path prefix -> why; the list can only shrink
DOC_EXEMPT = {
    "src/eagle3_pipeline/data/chat.py": "in the kept tiny builds' key (tiny/build_cache.py SOURCES): moves with a rebuild",
    "src/eagle3_pipeline/tiny/": "in the kept tiny builds' key (tiny/build_cache.py SOURCES): moves with a rebuild",
}


def long_docstring(source: str, limit: int = MAX_DOC_LINES) -> int | None:
    """The line count of `source`'s module docstring when it is over `limit`, else None."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    n = len(doc.splitlines()) if doc else 0
    return n if n > limit else None


def module_of(path: Path, core: Path = CORE) -> str:
    """Dotted module name of a file under the core (`eagle3_pipeline.extract.stage`)."""
    rel = Path(path).relative_to(core).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["eagle3_pipeline", *parts])


def stage_of(module: str) -> str | None:
    """The stage package a dotted module belongs to (None: ground floor or not ours)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "eagle3_pipeline" and parts[1] in STAGES else None


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "eagle3_pipeline" and parts[1] in ROOMS else None


def floor_violations(module: str, source: str) -> list[str]:
    """`line N: imported` for each import in `source` (the text of `module`, in a room) of a room on its own
    floor or above (its own room excepted), or of a module that stands above the stages."""
    own = room_of(module)
    bad = set()
    for n, m in imported_modules(source):
        other = room_of(m)
        parts = m.split(".")
        if above_stages(m) or (other is not None and other != own and ROOMS[other] >= ROOMS[own]):
            bad.add(f"line {n}: {'.'.join(parts[:2])}")
    return sorted(bad)


def above_stages(module: str) -> bool:
    """Whether a dotted module is in the room that stands above the stages (ABOVE_STAGES: pipeline/)."""
    parts = module.split(".")
    return len(parts) > 1 and parts[0] == "eagle3_pipeline" and parts[1] == ABOVE_STAGES


def layer_violations(module: str, source: str) -> list[str]:
    """`line N: imported` for each import in `source` (the text of `module`) that breaks the layers: a
    ground-floor module importing a stage package, a stage package importing a sibling, or either importing
    a module that stands above the stages."""
    own = stage_of(module)
    bad = set()
    for n, m in imported_modules(source):
        other = stage_of(m)
        if (other is not None and other != own) or above_stages(m):
            bad.add(f"line {n}: {'.'.join(m.split('.')[:2])}")
    return sorted(bad)


def stage_shape_problems(package_dir: Path) -> list[str]:
    """What keeps a stage package from the one shape: no stage.py, an __init__.py over INIT_MAX_LINES."""
    d = Path(package_dir)
    out = []
    if not (d / "stage.py").is_file():
        out.append(f"{d.name}: no stage.py")
    init = d / "__init__.py"
    n = len(init.read_text().splitlines()) if init.is_file() else 0
    if n > INIT_MAX_LINES:
        out.append(f"{d.name}/__init__.py: {n} lines (at most {INIT_MAX_LINES})")
    return out


def long_signatures(source: str, limit: int = MAX_PARAMS) -> dict[str, int]:
    """{function name: parameter count} of every function (methods too) over `limit` parameters;
    self/cls do not count, *args and **kwargs count one each."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            if n > limit:
                out[node.name] = n
    return out


def long_bodies(source: str, limit: int = MAX_LINES) -> dict[str, int]:
    """{function name: lines} of every function (methods and nested ones too) over `limit` lines."""
    return {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit}


# ---------------------------------------------------------------- the rules on this repository

def test_core_never_imports_prefect():
    bad = {str(p.relative_to(ROOT)): hits for p, s in _sources(CORE).items() if (hits := imports_of(s, "prefect"))}
    assert bad == {}, f"the core must not import Prefect (tasks/ and flows/ wrap it): {bad}"


def test_tasks_never_import_flows():
    bad = {str(p.relative_to(ROOT)): hits for p, s in _sources(ROOT / "tasks").items() if (hits := imports_of(s, "flows"))}
    assert bad == {}, f"import direction is flows -> tasks -> eagle3_pipeline; tasks/ imports flows/: {bad}"


def test_only_engine_py_constructs_vllm_llm():
    assert ENGINE.is_file(), "src/eagle3_pipeline/engine/build.py is the one place that builds a vLLM engine"
    assert llm_constructions(ENGINE.read_text()), "engine.py no longer constructs vllm.LLM: update this test"
    bad = {str(p.relative_to(ROOT)): hits for p, s in _sources(ROOT / "src", ROOT / "bench").items()
           if p != ENGINE and (hits := llm_constructions(s))}
    assert bad == {}, f"vllm.LLM constructed outside src/eagle3_pipeline/engine/build.py (use engine.build.build_llm): {bad}"


def test_no_top_level_worker_modules():
    assert top_level_workers(CORE) == [], \
        "a stage's child lives in its package as <stage>/worker.py (extract/, train/, evaluate/)"
    assert {p.parent.name for p in CORE.glob("*/worker.py")} >= {"extract", "train", "evaluate"}


def test_ground_floor_never_imports_a_stage():
    bad = {}
    for p, src in _sources(CORE).items():
        mod = module_of(p)
        if stage_of(mod) is None and not above_stages(mod):
            if hits := layer_violations(mod, src):
                bad[str(p.relative_to(ROOT))] = hits
    assert bad == {}, f"the ground floor imports a stage package (move the shared piece down): {bad}"
    here = {p.name for p in (CORE / ABOVE_STAGES).glob("*.py")}
    assert here == set(PIPELINE_MODULES), \
        f"pipeline/ holds {sorted(here)}: PIPELINE_MODULES names {sorted(PIPELINE_MODULES)} (each with why it is above the stages)"


def test_the_ground_floor_is_rooms_and_each_stands_on_the_floors_below():
    loose = sorted(p.name for p in CORE.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules loose in the package root (put each in its room, FLOORS, or in pipeline/): {loose}"
    packages = {p.parent.name for p in CORE.glob("*/*.py")}  # tiny/ is a namespace package
    assert packages - set(ROOMS) - set(STAGES) - {ABOVE_STAGES} == set(), \
        "a package that is neither a room (FLOORS), a stage (the registry's) nor the pipeline room"
    assert set(ROOMS) <= packages, f"FLOORS names a room that is gone: {set(ROOMS) - packages}"
    bad = {}
    for room in ROOMS:
        for p, src in _sources(CORE / room).items():
            if hits := floor_violations(module_of(p), src):
                bad[str(p.relative_to(ROOT))] = hits
    assert bad == {}, f"a room imports one beside or above it (FLOORS: {FLOORS}): {bad}"


def test_module_docstrings_are_short():
    found = {str(p.relative_to(ROOT)): n for p, s in _sources(CORE, ROOT / "flows", ROOT / "tasks").items()
             if (n := long_docstring(s))}
    bad = {f: n for f, n in found.items() if not f.startswith(tuple(DOC_EXEMPT))}
    assert bad == {}, f"module docstrings over {MAX_DOC_LINES} lines (move the how and why to docs/internals.md): {bad}"
    stale = [e for e in DOC_EXEMPT if not any(f.startswith(e) for f in found)]
    assert stale == [], f"{stale} hold no docstring over {MAX_DOC_LINES} lines now: drop them from DOC_EXEMPT"


def test_no_private_name_crosses_a_module_line():
    bad = {str(p.relative_to(ROOT)): hits for p, s in _sources(CORE, ROOT / "flows", ROOT / "tasks").items()
           if (hits := private_imports(s))}
    assert bad == {}, f"a private name imported from another module (make it public, or keep it in its module): {bad}"


def test_no_stage_imports_a_sibling_stage():
    bad = {}
    for p, src in _sources(*(CORE / s for s in STAGES)).items():
        if hits := layer_violations(module_of(p), src):
            bad[str(p.relative_to(ROOT))] = hits
    assert bad == {}, f"a stage package imports a sibling stage (move the shared piece down, or call both from stages.py): {bad}"


def test_every_stage_has_one_shape():
    assert {p.parent.name for p in CORE.glob("*/__init__.py")} >= set(STAGES)
    bad = {s: probs for s in STAGES
           if (probs := [x for x in stage_shape_problems(CORE / s) if not (s in NO_STAGE_PY and x.endswith("no stage.py"))])}
    assert bad == {}, f"stage packages out of shape: {bad}"
    stale = [s for s in NO_STAGE_PY if (CORE / s / "stage.py").is_file()]
    assert stale == [], f"{stale} have stage.py now: drop them from NO_STAGE_PY"


def _against_exceptions(measure, exceptions: dict[str, str]) -> tuple[dict[str, int], list[str]]:
    """(functions over the limit not listed in `exceptions`, listed ones no longer over it) in the core."""
    found = {f"{p.relative_to(CORE).as_posix()}:{name}": n
             for p, src in _sources(CORE).items() for name, n in measure(src).items()}
    return {k: n for k, n in found.items() if k not in exceptions}, sorted(set(exceptions) - set(found))


def test_no_function_over_six_parameters():
    new, fixed = _against_exceptions(long_signatures, PARAM_EXCEPTIONS)
    assert new == {}, f"functions over {MAX_PARAMS} parameters (pass a typed record whole): {new}"
    assert fixed == [], f"{fixed} take {MAX_PARAMS} parameters or fewer now (or are gone): drop them from PARAM_EXCEPTIONS"


def test_no_function_over_sixty_lines_without_a_reason():
    """Over MAX_LINES lines only with a reason, and never longer than its cap (the core, flows/ and tasks/)."""
    found = {}
    for base, prefix in ((CORE, ""), (ROOT / "flows", "flows/"), (ROOT / "tasks", "tasks/")):
        found |= {f"{prefix}{p.relative_to(base).as_posix()}:{name}": n
                  for p, src in _sources(base).items() for name, n in long_bodies(src).items()}
    new = {k: n for k, n in found.items() if k not in LONG_FUNCTIONS}
    assert new == {}, f"functions over {MAX_LINES} lines (split them, or give a one-line reason in LONG_FUNCTIONS): {new}"
    fixed = sorted(set(LONG_FUNCTIONS) - set(found))
    assert fixed == [], f"{fixed} are {MAX_LINES} lines or fewer now (or gone): drop them from LONG_FUNCTIONS"
    grown = {k: (n, LONG_FUNCTIONS[k][0]) for k, n in found.items() if k in LONG_FUNCTIONS and n > LONG_FUNCTIONS[k][0]}
    assert grown == {}, f"(lines, cap) of listed functions that grew past their cap (caps only go down): {grown}"
    assert all(cap > MAX_LINES and why and "\n" not in why for cap, why in LONG_FUNCTIONS.values())
    assert len(LONG_FUNCTIONS) <= MAX_LISTED and all(cap <= MAX_LISTED_LINES for cap, _ in LONG_FUNCTIONS.values()), \
        f"at most {MAX_LISTED} functions over {MAX_LINES} lines, none over {MAX_LISTED_LINES}: split one"


# ---------------------------------------------------------------- each checker can fail

@pytest.mark.parametrize("source, expected", [
    ("import prefect\n", ["line 1: prefect"]),
    ("from prefect import flow\n", ["line 1: prefect", "line 1: prefect.flow"]),
    ("def f():\n    from prefect.artifacts import create_table_artifact\n",
     ["line 2: prefect.artifacts", "line 2: prefect.artifacts.create_table_artifact"]),
    ("class C:\n    def m(self):\n        if True:\n            import prefect.runtime as rt\n", ["line 4: prefect.runtime"]),
    ("import prefect_kubernetes\nimport json\nfrom . import prefect\n'''import prefect'''\n", []),
])
def test_prefect_checker_finds_imports_at_any_depth(source, expected):
    assert imports_of(source, "prefect") == expected


def test_flows_checker_finds_tasks_importing_flows():
    assert imports_of("from flows.extract import extract\n", "flows") == ["line 1: flows.extract",
                                                                           "line 1: flows.extract.extract"]
    assert imports_of("def f():\n    import flows\n", "flows") == ["line 2: flows"]
    assert imports_of("from eagle3_pipeline import stages\nimport flowsheet\n", "flows") == []


@pytest.mark.parametrize("source, expected", [
    ("from vllm import LLM\nllm = LLM(model='m')\n", ["line 2: LLM(...)"]),
    ("import vllm\nllm = vllm.LLM(model='m')\n", ["line 2: vllm.LLM(...)"]),
    ("import vllm as v\ndef f():\n    return v.LLM(model='m')\n", ["line 3: v.LLM(...)"]),
    ("from vllm import LLM as Engine\nEngine(model='m')\n", ["line 2: Engine(...)"]),
    ("from eagle3_pipeline.engine.build import build_llm\nbuild_llm(e, t, max_model_len=8)\nx = 'LLM(model)'\n", []),
])
def test_llm_checker_finds_constructions(source, expected):
    assert llm_constructions(source) == expected


def test_worker_checker_finds_top_level_workers(tmp_path):
    (tmp_path / "extract").mkdir()
    (tmp_path / "extract" / "worker.py").write_text("")
    (tmp_path / "engine.py").write_text("")
    assert top_level_workers(tmp_path) == []
    (tmp_path / "train_worker.py").write_text("")
    assert top_level_workers(tmp_path) == ["train_worker.py"]


def test_layer_checker_finds_crossings():
    assert layer_violations("eagle3_pipeline.records.layout", "from eagle3_pipeline.extract.stage import x\n") == \
        ["line 1: eagle3_pipeline.extract"]
    assert layer_violations("eagle3_pipeline.report.runs", "def f():\n    import eagle3_pipeline.verify.stage\n") == \
        ["line 2: eagle3_pipeline.verify"]
    assert layer_violations("eagle3_pipeline.train.online", "from eagle3_pipeline.verify import gate\n") == \
        ["line 1: eagle3_pipeline.verify"]
    assert layer_violations("eagle3_pipeline.report.record", "def f():\n    from eagle3_pipeline.pipeline.registry import STAGES\n") == \
        ["line 2: eagle3_pipeline.pipeline"]
    # prepare is a stage like any other: its dataset reader is on the ground floor (data/tokenized.py)
    assert layer_violations("eagle3_pipeline.verify.masks", "from eagle3_pipeline.prepare.stage import load_tokenized\n") == \
        ["line 1: eagle3_pipeline.prepare"]
    # a stage's own modules, the ground floor and other packages are fine
    assert layer_violations("eagle3_pipeline.train.stage", "from eagle3_pipeline.train.job import x\n"
                            "from eagle3_pipeline.records.vocab import y\nfrom eagle3_pipeline.data.tokenized import z\n"
                            "import extract\nfrom . import verify\n") == []
    assert stage_of("eagle3_pipeline.records.pool") is None and stage_of("eagle3_pipeline.evaluate.ngram") == "evaluate"
    assert module_of(CORE / "train" / "__init__.py") == "eagle3_pipeline.train"


def test_docstring_checker():
    assert long_docstring('"""one\n\ntwo\n"""\nx = 1\n', limit=2) == 3
    assert long_docstring('"""one"""\n', limit=2) is None and long_docstring("x = 1\n") is None


def test_private_import_checker():
    assert private_imports("from eagle3_pipeline.data.chat import _form, ok\nfrom flows.cli import _k\n") == \
        ["line 1: eagle3_pipeline.data.chat._form", "line 2: flows.cli._k"]
    assert private_imports("from os import _exit\nfrom eagle3_pipeline import __version__\nfrom . import _x\n") == []


def test_floor_checker_finds_imports_beside_and_above():
    assert floor_violations("eagle3_pipeline.records.layout", "from eagle3_pipeline.engine.build import x\n") == \
        ["line 1: eagle3_pipeline.engine"]
    assert floor_violations("eagle3_pipeline.core.store", "def f():\n    import eagle3_pipeline.records.pool\n") == \
        ["line 2: eagle3_pipeline.records"]
    assert floor_violations("eagle3_pipeline.data.chat", "from eagle3_pipeline.records import contracts\n") == \
        ["line 1: eagle3_pipeline.records"]  # beside: the same floor
    assert floor_violations("eagle3_pipeline.engine.build", "from eagle3_pipeline.pipeline.stages import plan_extract\n") == \
        ["line 1: eagle3_pipeline.pipeline"]
    assert floor_violations("eagle3_pipeline.engine.build", "from eagle3_pipeline.engine.start import x\n"
                            "from eagle3_pipeline.records.contracts import y\nfrom eagle3_pipeline.core import store\n"
                            "import records\n") == []


def test_stage_shape_checker_finds_a_missing_stage_py_and_a_long_init(tmp_path):
    d = tmp_path / "evaluate"
    d.mkdir()
    (d / "__init__.py").write_text('"""doc"""\n')
    assert stage_shape_problems(d) == ["evaluate: no stage.py"]
    (d / "stage.py").write_text("")
    assert stage_shape_problems(d) == []
    (d / "__init__.py").write_text("x = 1\n" * (INIT_MAX_LINES + 1))
    assert stage_shape_problems(d) == [f"evaluate/__init__.py: {INIT_MAX_LINES + 1} lines (at most {INIT_MAX_LINES})"]


def test_length_checker_counts_lines():
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    src = f"def ok():\n{body}\ndef over():\n{body}    y = 1\nclass C:\n    def m(self):\n        def inner():\n" + \
        "".join(f"            z{i} = {i}\n" for i in range(61))
    assert long_bodies(src) == {"over": 61, "m": 63, "inner": 62}


def test_signature_checker_counts_parameters():
    src = ("def ok(a, b, c, d, e, f): pass\n"
           "def over(a, b, c, d, e, f, g): pass\n"
           "def kw(a, b, c, *, d, e, f, g=1): pass\n"
           "def star(a, b, c, d, e, *args, **kwargs): pass\n"
           "class C:\n    def m(self, a, b, c, d, e, f): pass\n    def n(self, a, b, c, d, e, f, g): pass\n")
    assert long_signatures(src) == {"over": 7, "kw": 7, "star": 7, "n": 7}


# ---------------------------------------------------------------- the stage interface (these import the stage modules)

def stage_spec_problems(name: str, module, package_dir: Path) -> list[str]:
    """What keeps a stage's `STAGE` (core.stage_spec.StageSpec in its package's stage.py) from the interface."""
    import typing

    from pydantic import BaseModel

    from eagle3_pipeline.core.errors import is_transient
    from eagle3_pipeline.core.stage_spec import StageSpec

    spec = getattr(module, "STAGE", None)
    if not isinstance(spec, StageSpec):
        return [f"{name}/stage.py: no STAGE = StageSpec(...)"]
    out = []
    if spec.name != name:
        out.append(f"STAGE.name {spec.name!r} is not the package's name {name!r}")
    if getattr(spec.run, "__module__", None) != module.__name__:
        out.append(f"STAGE.run {getattr(spec.run, '__qualname__', spec.run)} is not defined in {module.__name__}")
    else:
        out += entry_signature_problems(spec.run, spec.result)
    inner = typing.get_args(spec.result)[0] if typing.get_origin(spec.result) is list else spec.result
    if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
        out.append(f"STAGE.result {spec.result} is not a pydantic record (or a list of them)")
    home = Path(package_dir)
    sources = [home.read_text()] if home.is_file() else _sources(home).values()
    if spec.failure is not None:
        raised = {ast.unparse(n.exc.func if isinstance(n.exc, ast.Call) else n.exc).split(".")[-1]
                  for src in sources for n in ast.walk(ast.parse(src))
                  if isinstance(n, ast.Raise) and n.exc is not None}
        if spec.failure.__name__ not in raised:
            out.append(f"STAGE.failure {spec.failure.__name__} is raised nowhere in {home.name}")
    has_worker = home.is_dir() and (home / "worker.py").is_file()
    if has_worker != (spec.worker is not None) or (has_worker and spec.worker != f"eagle3_pipeline.{name}.worker"):
        out.append(f"STAGE.worker {spec.worker!r} but {name}/worker.py {'exists' if has_worker else 'does not'}")
    if spec.accelerators and spec.worker is None:
        out.append("STAGE.accelerators without a worker: a model on accelerators is loaded in a child process")
    if spec.gate and spec.failure is not None and is_transient(spec.failure("its own answer"), spec.retry.transient):
        out.append(f"STAGE.retry retries on {spec.failure.__name__}: a gate's refusal is an answer, never transient")
    return out


def entry_signature_problems(run, result) -> list[str]:
    """What keeps `run` from the one entry signature `run(cfg: PipelineConfig, inputs: <a pydantic record>,
    log: Log) -> result` (core/stage_spec.py)."""
    import inspect
    import typing

    from pydantic import BaseModel

    from eagle3_pipeline.core.config import PipelineConfig
    from eagle3_pipeline.core.stage_spec import Log

    name = getattr(run, "__qualname__", run)
    params = list(inspect.signature(run).parameters.values())
    if [p.name for p in params] != ["cfg", "inputs", "log"] or any(p.kind != p.POSITIONAL_OR_KEYWORD for p in params):
        return [f"STAGE.run {name}{inspect.signature(run)} is not run(cfg, inputs, log)"]
    hints, out = typing.get_type_hints(run), []
    if hints.get("cfg") is not PipelineConfig:
        out.append(f"STAGE.run {name}: cfg is {hints.get('cfg')}, not PipelineConfig")
    if not (isinstance(hints.get("inputs"), type) and issubclass(hints["inputs"], BaseModel)):
        out.append(f"STAGE.run {name}: inputs is {hints.get('inputs')}, not a pydantic record")
    if hints.get("log") != Log:
        out.append(f"STAGE.run {name}: log is {hints.get('log')}, not core.stage_spec.Log")
    if hints.get("return") != result:
        out.append(f"STAGE.run returns {hints.get('return')}, STAGE.result is {result}")
    return out


def _home(stage: str) -> Path:
    """Where a registered stage's STAGE is declared: its package's stage.py."""
    return CORE / stage / "stage.py"


def test_every_stage_declares_the_stage_interface():
    import importlib

    bad = {}
    for s, spec in REGISTERED.items():
        mod = importlib.import_module(module_of(_home(s)))
        if mod.STAGE is not spec:
            bad[s] = [f"registry.STAGES holds another StageSpec than {_home(s).relative_to(CORE)}'s STAGE"]
        elif p := stage_spec_problems(s, mod, CORE / s):
            bad[s] = p
    assert bad == {}, f"stages out of the interface (core/stage_spec.py): {bad}"


def test_the_registry_is_the_one_list_of_stages():
    """registry.STAGES: each stage once, each task once, each with a package of its own; the one list below the
    registry that names stages (it cannot be read from there) is its own: report.json's typed entries in its order;
    the Jobs' stages are read from it."""
    from eagle3_pipeline.pipeline import jobs
    from eagle3_pipeline.report.record import Stages

    assert len(set(registry.NAMES)) == len(registry.NAMES) and len(set(registry.TASKS)) == len(registry.TASKS)
    unpackaged = sorted(n for n in REGISTERED if not (CORE / n / "stage.py").is_file())
    assert unpackaged == [], f"registered stages without a package of their own (<name>/stage.py): {unpackaged}"
    assert tuple(Stages.model_fields) == registry.REPORTED, \
        f"report/record.py Stages {tuple(Stages.model_fields)}: the reported stages in run order are {registry.REPORTED}"
    assert jobs.GPU_STAGES is registry.JOB_STAGES


def test_every_stage_entry_has_the_one_signature():
    """Every registered StageSpec's run is `run(cfg: PipelineConfig, inputs: <its record>, log: Log) -> result`, and
    so is what runs train in online and window mode instead (pipeline/stages.py `entry`, TRAIN_MODES)."""
    from eagle3_pipeline.pipeline.online_training import train_online

    bad = {s: p for s, spec in REGISTERED.items() if (p := entry_signature_problems(spec.run, spec.result))}
    assert bad == {}, f"stage entries off the one signature: {bad}"
    from eagle3_pipeline.pipeline.stages import TRAIN_MODES

    assert {m: entry_signature_problems(f, REGISTERED["train"].result) for m, f in TRAIN_MODES.items()} == \
        {"online": [], "window": []}
    assert TRAIN_MODES["online"] is train_online


def test_every_stage_runs_through_its_spec():
    """pipeline/stages.py runs each stage by its spec (entry: STAGE.run, online train aside), and tasks/ builds
    one task per registered stage from the registry (stage_task), none by hand."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline import stages
    from eagle3_pipeline.pipeline.online_training import train_online

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    online = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["train.mode=online"])
    assert all(stages.entry(spec, cfg) is spec.run for spec in registry.STAGES)
    assert stages.entry(registry.spec("train"), online) is train_online
    window = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["train.mode=window"])
    assert stages.entry(registry.spec("train"), window) is stages.TRAIN_MODES["window"]
    assert set(stages.NEEDS) <= set(registry.NAMES)
    import tasks.stage_tasks as t

    assert list(t.TASKS) == [n for n in registry.NAMES if n != "report"]  # every stage's task, from its spec alone
    assert [t.TASKS[n].name for n in t.TASKS] == [registry.spec(n).task_name for n in t.TASKS]
    assert set(t.ARTIFACTS) | set(t.OPTIONS) <= set(t.TASKS) and t.report.name == registry.spec("report").task_name


def test_stages_on_accelerators_run_under_a_gpu_slot(monkeypatch):
    import tasks.stage_tasks as t

    monkeypatch.setattr(t, "gpu_slot", lambda: "gpu slot")
    held = {spec.name: t.slot_for(spec) == "gpu slot" for spec in registry.STAGES}
    assert held == {spec.name: spec.accelerators for spec in registry.STAGES}
    assert {"extract", "verify", "train", "evaluate", "regenerate"} <= {s for s, h in held.items() if h}


def test_stage_interface_checkers_fail(tmp_path):
    import types

    from pydantic import BaseModel

    from eagle3_pipeline.core.config import PipelineConfig
    from eagle3_pipeline.core.stage_spec import Log, Retry, StageSpec

    class Rec(BaseModel):
        x: int = 0

    class Refused(RuntimeError):
        pass

    mod = types.ModuleType("eagle3_pipeline.demo.stage")

    def run(cfg, inputs, log):
        return Rec()

    run.__module__ = mod.__name__
    run.__annotations__ = {"cfg": PipelineConfig, "inputs": Rec, "log": Log, "return": Rec}
    (tmp_path / "stage.py").write_text("def run():\n    raise Refused('no')\n")
    mod.STAGE = StageSpec(name="demo", run=run, result=Rec, failure=Refused)
    assert stage_spec_problems("demo", mod, tmp_path) == []
    assert stage_spec_problems("other", mod, tmp_path) == ["STAGE.name 'demo' is not the package's name 'other'"]
    mod.STAGE = StageSpec(name="demo", run=run, result=list[Rec], failure=Refused, accelerators=True)
    assert stage_spec_problems("demo", mod, tmp_path) == [
        f"STAGE.run returns {Rec}, STAGE.result is list[{Rec.__module__}.{Rec.__qualname__}]",
        "STAGE.accelerators without a worker: a model on accelerators is loaded in a child process"]
    (tmp_path / "worker.py").write_text("")
    (tmp_path / "stage.py").write_text("def run():\n    raise ValueError('no')\n")
    mod.STAGE = StageSpec(name="demo", run=run, result=Rec, failure=Refused)
    assert stage_spec_problems("demo", mod, tmp_path) == [f"STAGE.failure Refused is raised nowhere in {tmp_path.name}",
                                                          "STAGE.worker None but demo/worker.py exists"]
    (tmp_path / "worker.py").unlink()
    (tmp_path / "stage.py").write_text("def run():\n    raise Refused('no')\n")
    mod.STAGE = StageSpec(name="demo", run=run, result=Rec, failure=Refused, retry=Retry(1, 5, (RuntimeError,), "demo"))
    assert stage_spec_problems("demo", mod, tmp_path) == []  # not a gate: a refusal a retry may pass (ExtractFailed)
    mod.STAGE = StageSpec(name="demo", run=run, result=Rec, failure=Refused, gate=True,
                          retry=Retry(1, 5, (RuntimeError,), "demo"))
    assert stage_spec_problems("demo", mod, tmp_path) == [
        "STAGE.retry retries on Refused: a gate's refusal is an answer, never transient"]
    def old_entry(cfg, target, version, *, log):
        return Rec()

    old_entry.__module__ = mod.__name__
    mod.STAGE = StageSpec(name="demo", run=old_entry, result=Rec, failure=Refused)
    assert stage_spec_problems("demo", mod, tmp_path) == [
        "STAGE.run test_stage_interface_checkers_fail.<locals>.old_entry(cfg, target, version, *, log) is not "
        "run(cfg, inputs, log)"]
    run.__annotations__ = {"cfg": dict, "inputs": int, "log": Log, "return": Rec}
    assert entry_signature_problems(run, Rec) == [
        f"STAGE.run {run.__qualname__}: cfg is {dict}, not PipelineConfig",
        f"STAGE.run {run.__qualname__}: inputs is {int}, not a pydantic record"]
    del mod.STAGE
    assert stage_spec_problems("demo", mod, tmp_path) == ["demo/stage.py: no STAGE = StageSpec(...)"]


# ---------------------------------------------------------------- imports: at module top, the heavy ones lazy

HEAVY = ("torch", "vllm", "speculators", "transformers", "prefect")  # pyproject [tool.ruff] banned-module-level-imports


def heavy_loaded(*modules: str) -> list[str]:
    """The HEAVY libraries a fresh interpreter holds after importing `modules` (the project's, from this checkout)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import importlib, json, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            f"print(json.dumps([h for h in {HEAVY!r} if h in sys.modules]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CORE.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def test_the_cli_and_every_stage_module_import_no_heavy_library():
    """`eagle3 --help` and the parent side of every stage (the registry imports each stage.py, pipeline/stages.py the
    rest) load none of the heavy libraries: those are imported in the function that needs them (docs/internals.md,
    "Imports"). The check sees a load: a flow module imports Prefect."""
    assert heavy_loaded("flows.cli", "eagle3_pipeline.pipeline.stages", "eagle3_pipeline.pipeline.store_gc") == []
    assert heavy_loaded("flows.pipeline") == ["prefect"]
