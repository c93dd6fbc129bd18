"""The layout rules of DESIGN §4, checked on the source (parsed with `ast`, nothing imported):
  - the core (src/eagle3_pipeline) never imports Prefect, not even inside a function;
  - the import direction is flows -> tasks -> eagle3_pipeline: tasks/ never imports flows/;
  - one place builds a vLLM engine: nothing but src/eagle3_pipeline/engine.py constructs `vllm.LLM`
    (src/ and bench/ are checked);
  - one shape per stage: a stage's child is `<stage>/worker.py`, never a top-level `*_worker.py`.
Each checker takes source text, so each rule is also shown to fail on a small synthetic violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "src" / "eagle3_pipeline"
ENGINE = CORE / "engine.py"


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


def top_level_workers(package_dir: Path) -> list[str]:
    return sorted(p.name for p in Path(package_dir).glob("*_worker.py"))


# ---------------------------------------------------------------- the rules on this repository

def test_core_never_imports_prefect():
    bad = {str(p.relative_to(ROOT)): hits for p, s in _sources(CORE).items() if (hits := imports_of(s, "prefect"))}
    assert bad == {}, f"the core must not import Prefect (tasks/ and flows/ wrap it): {bad}"


def test_tasks_never_import_flows():
    bad = {str(p.relative_to(ROOT)): hits for p, s in _sources(ROOT / "tasks").items() if (hits := imports_of(s, "flows"))}
    assert bad == {}, f"import direction is flows -> tasks -> eagle3_pipeline; tasks/ imports flows/: {bad}"


def test_only_engine_py_constructs_vllm_llm():
    assert ENGINE.is_file(), "src/eagle3_pipeline/engine.py is the one place that builds a vLLM engine"
    assert llm_constructions(ENGINE.read_text()), "engine.py no longer constructs vllm.LLM: update this test"
    bad = {str(p.relative_to(ROOT)): hits for p, s in _sources(ROOT / "src", ROOT / "bench").items()
           if p != ENGINE and (hits := llm_constructions(s))}
    assert bad == {}, f"vllm.LLM constructed outside src/eagle3_pipeline/engine.py (use engine.build_llm): {bad}"


def test_no_top_level_worker_modules():
    assert top_level_workers(CORE) == [], \
        "a stage's child lives in its package as <stage>/worker.py (extract/, train/, evaluate/)"
    assert {p.parent.name for p in CORE.glob("*/worker.py")} >= {"extract", "train", "evaluate"}


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
    ("from eagle3_pipeline.engine import build_llm\nbuild_llm(e, t, max_model_len=8)\nx = 'LLM(model)'\n", []),
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
