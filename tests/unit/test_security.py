"""Security properties, each checked against the real code:
(a) no pickle on data paths (a scan of src/, flows/, tasks/, deployments/ that names file:line);
(b) a malicious pickle placed where the pipeline reads data is refused with a clear error, and the
    code inside it never runs;
(c) `trust_remote_code` reaches every model/tokenizer load from the config only, default False;
(d) store paths built from configured names stay under the store root;
(e) the hub token comes from the environment (or a Prefect Secret block the flows resolve into it)
    and is never logged or written.
The scanners are tested on snippets with each violation, so a scan that finds nothing means
something."""

from __future__ import annotations

import ast
import json
import logging
import os
import pickle
import uuid
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eagle3_pipeline.core.config import PrepareConfig, SourceConfig, TargetConfig, load_config
from eagle3_pipeline.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("src", "flows", "tasks", "deployments")


def sources() -> list[Path]:
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 30, files  # the scan covers the project, not an empty glob
    return files


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return dotted(node.func) + "()"
    return "?"


# ------------------------------------------------------------------------- (a) pickle scan

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}


def pickle_uses(text: str, name: str) -> list[str]:
    """`name:line: what` for every way this source could unpickle data."""
    out = []
    for node in ast.walk(ast.parse(text, name)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in PICKLE_MODULES:
                out.append(f"{where}: from {node.module} import ...")
            elif mod == "torch" and any(a.name == "load" for a in node.names):
                out.append(f"{where}: from torch import load")
        elif isinstance(node, ast.Call):
            fn = dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            last = fn.split(".")[-1]
            if fn.startswith("torch.") and last == "load":
                wo = kw.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    out.append(f"{where}: {fn}(...) without weights_only=True")
            elif last == "load" and fn.split(".")[0] in ("np", "numpy"):
                ap = kw.get("allow_pickle")
                if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                    out.append(f"{where}: {fn}(..., allow_pickle={ast.unparse(ap)})")
            elif fn.split(".")[0] in PICKLE_MODULES and last in ("load", "loads", "Unpickler"):
                out.append(f"{where}: {fn}(...)")
            elif last in ("read_pickle", "to_pickle"):
                out.append(f"{where}: {fn}(...)")
    return out


def test_pickle_scanner_finds_each_kind():
    snippet = "\n".join([
        "import pickle", "import joblib", "from dill import loads", "import numpy as np", "import torch",
        "from torch import load",
        "a = pickle.load(f)", "b = torch.load(p)", "c = torch.load(p, weights_only=False)",
        "d = np.load(p, allow_pickle=True)", "e = pd.read_pickle(p)", "f = numpy.load(p, allow_pickle=flag)",
        # compliant:
        "g = torch.load(p, weights_only=True)", "h = np.load(p)", "i = np.load(p, allow_pickle=False)",
        "j = json.load(f)"])
    found = pickle_uses(snippet, "x.py")
    assert [f.split(":")[1] for f in found] == ["1", "2", "3", "6", "7", "8", "9", "10", "11", "12"], found


def test_no_pickle_on_data_paths():
    found = [f for p in sources() for f in pickle_uses(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "pickle on a data path:\n" + "\n".join(found)


# --------------------------------------------------------------------- (b) malicious pickles

class Payload:
    """Unpickling this creates `marker` (what an attacker's code would do, harmlessly)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_the_payload_is_live(tmp_path):
    """Control: unpickling the payload does run its code, so a marker that stays absent below means
    the pipeline never unpickled the file."""
    import torch

    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()
    marker.unlink()
    torch.save({"hidden_states": Payload(marker)}, tmp_path / "x.pt")
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


def _malicious(kind: str, path: Path, marker: Path) -> None:
    if kind == "pickle":
        path.write_bytes(pickle.dumps(Payload(marker)))
    elif kind == "torch.save":
        import torch

        torch.save({"hidden_states": Payload(marker), "token_ids": torch.zeros(3, dtype=torch.int64)}, path)
    elif kind == "npy object array":
        np.save(path, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    else:
        raise ValueError(kind)


@pytest.fixture(scope="module")
def tokenized(tiny_target, tmp_path_factory) -> Path:
    from eagle3_pipeline.prepare.stage import prepare

    d = tmp_path_factory.mktemp("sec")
    src = d / "a.jsonl"
    src.write_text("".join(json.dumps({"id": f"g{i}", "messages": [
        {"role": "user", "content": f"What is {i} + 2?"}, {"role": "assistant", "content": f"{i + 2}."}]}) + "\n"
        for i in range(6)))
    res = prepare(PrepareConfig(sources=[SourceConfig(path=str(src))], heldout_rows=0),
                  TargetConfig(model=str(tiny_target)), d / "store", log=lambda m: None)
    return Path(res.tokenized)


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_pickle_disguised_as_a_hidden_state_shard(tokenized, tmp_path, kind):
    from eagle3_pipeline.verify.structure import StructureCheck, verify_structure

    hs, marker = tmp_path / "hidden_states", tmp_path / "pwned"
    hs.mkdir()
    _malicious(kind, hs / "hs_0.safetensors", marker)
    res = verify_structure(StructureCheck(tokenized, hs, [2, 4, 5, 8], 128), rows=[0], log=lambda m: None)
    assert not res.passed and res.bad_rows == [0]
    assert res.problems[0].startswith("hs_0.safetensors (row 0, sample g") and ": unreadable (ValueError: " in res.problems[0]
    assert not marker.exists()


@pytest.mark.parametrize("which", ["d2t", "t2d"])
@pytest.mark.parametrize("kind", ["pickle", "npy object array"])
def test_pickle_disguised_as_a_vocab_file(tmp_path, which, kind):
    from eagle3_pipeline.records.vocab import VocabError, load_vocab

    vocab, marker = tmp_path / "vocab", tmp_path / "pwned"
    vocab.mkdir()
    good = {"d2t": np.zeros(4, dtype=np.int64), "t2d": np.array([True] * 4 + [False] * 4)}
    for name, arr in good.items():
        path = vocab / f"{name}-4.npy"
        if name == which:
            _malicious(kind, path, marker)
        else:
            np.save(path, arr)
    with pytest.raises(VocabError) as ei:
        load_vocab(vocab, 8)
    assert str(ei.value).startswith(f"{vocab / f'{which}-4.npy'}: not a plain numeric .npy array (")
    assert "pickled data is never loaded" in str(ei.value)
    assert not marker.exists()


def test_pickle_disguised_as_token_frequencies(tmp_path):
    from eagle3_pipeline.records.vocab import VocabError
    from eagle3_pipeline.vocab.stage import read_token_freq

    path, marker = tmp_path / "token_freq.safetensors", tmp_path / "pwned"
    _malicious("pickle", path, marker)
    with pytest.raises(VocabError, match=f"token frequencies {path}: not a readable safetensors file"):
        read_token_freq(path, 908)
    assert not marker.exists()


# -------------------------------------------------------------------- (c) trust_remote_code

LOADERS = {"from_pretrained", "LLM"}  # every call of these must pass trust_remote_code=; so must every call
# of our own functions/records that take it, and every other call that passes it must pass the configured value


def _from_config(value: ast.AST) -> bool:
    """An expression that carries the configured value (target.trust_remote_code, job[...], a
    parameter of that name), not a literal."""
    return not isinstance(value, ast.Constant) and "trust_remote_code" in ast.unparse(value)


def _is_false(value: ast.AST | None) -> bool:
    if isinstance(value, ast.Call) and value.args:  # pydantic Field(False, ...)
        value = value.args[0]
    return isinstance(value, ast.Constant) and value.value is False


def remote_code_problems(files: dict[str, str]) -> tuple[list[str], int]:
    """(problems, number of calls checked) over {name: source}: loaders that do not pass the
    configured value, our own functions/records with a trust_remote_code parameter called without
    it, and parameters/fields whose default is not False."""
    trees = {name: ast.parse(text, name) for name, text in files.items()}
    takes: set[str] = set()  # our callables with a trust_remote_code parameter or field
    problems, checked = [], 0
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + \
                    node.args.kw_defaults
                for a, d in zip(args, defaults):
                    if a.arg == "trust_remote_code":
                        takes.add(node.name)
                        if d is not None and not _is_false(d):
                            problems.append(f"{name}:{node.lineno}: {node.name}(trust_remote_code={ast.unparse(d)})")
            elif isinstance(node, ast.ClassDef):
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and getattr(st.target, "id", None) == "trust_remote_code":
                        if node.name != "TargetConfig":  # the config itself is where the value comes from
                            takes.add(node.name)
                        if not _is_false(st.value):
                            problems.append(f"{name}:{st.lineno}: {node.name}.trust_remote_code default "
                                            f"{ast.unparse(st.value) if st.value else 'missing'}")
    for name, tree in trees.items():
        scope = {}  # node -> its enclosing function (or the module)
        for outer in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for n in ast.walk(outer):
                scope[n] = outer  # inner functions are walked later and overwrite
        for call in [n for n in ast.walk(tree) if isinstance(n, ast.Call)]:
            callee = dotted(call.func).split(".")[-1]
            if callee not in LOADERS | takes and not any(k.arg == "trust_remote_code" for k in call.keywords):
                continue
            checked += 1
            kws = {k.arg: k.value for k in call.keywords if k.arg}
            for k in call.keywords:  # LLM(**kwargs) with `kwargs = dict(...)` in the same function
                if k.arg is None and isinstance(k.value, ast.Name):
                    for n in ast.walk(scope[call]):
                        if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and dotted(n.value.func) == "dict"
                                and any(getattr(t, "id", None) == k.value.id for t in n.targets)):
                            kws.update({kk.arg: kk.value for kk in n.value.keywords if kk.arg})
            value = kws.get("trust_remote_code")
            if value is None and callee in takes:  # our own function or record: positionally is fine too
                value = next((a for a in call.args if _from_config(a)), None)
            if value is None:
                problems.append(f"{name}:{call.lineno}: {dotted(call.func)}(...) without trust_remote_code=")
            elif not (_from_config(value) or _is_false(value)):  # a literal False never trusts anything
                problems.append(f"{name}:{call.lineno}: {dotted(call.func)}(trust_remote_code="
                                f"{ast.unparse(value)}) is not the configured value")
    return problems, checked


def test_remote_code_scanner_finds_each_kind():
    snippet = "\n".join([
        "def load(target):",
        "    a = AutoTokenizer.from_pretrained(target.tokenizer)",                             # 2: missing
        "    b = AutoModel.from_pretrained(target.model, trust_remote_code=True)",             # 3: literal
        "    c = LLM(model=target.model, trust_remote_code=target.trust_remote_code)",         # ok
        "    kwargs = dict(model=target.model, trust_remote_code=target.trust_remote_code)",
        "    d = LLM(**kwargs)",                                                               # ok
        "    e = check(target.model, target.trust_remote_code)",                               # ok (positional)
        "    f = check(target.model)",                                                         # 8: missing
        "def check(model, trust_remote_code: bool = True):",                                   # 9: default
        "    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)",   # ok
        "class Job(BaseModel):",
        "    trust_remote_code: bool = True",                                                  # 12: default
        "j = Job(model='m')",                                                                  # 13: missing
    ])
    problems, checked = remote_code_problems({"x.py": snippet})
    assert sorted(int(p.split(":")[1]) for p in problems) == [2, 3, 8, 9, 12, 13], problems
    assert checked == 9  # the 8 calls above and the dict(...) that passes it


def test_trust_remote_code_only_from_config_and_off_by_default():
    files = {str(p.relative_to(ROOT)): p.read_text() for p in sources()}
    problems, checked = remote_code_problems(files)
    assert not problems, "\n".join(problems)
    # what this covers: the tokenizer, AutoConfig, the HF reference model, the one place that builds a
    # vLLM engine (engine.build_llm: its kwargs and the LLM call), the speculators draft (its layer config
    # and the model); the engine children's jobs carry the TargetConfig itself (below)
    assert checked >= 7, checked
    assert TargetConfig(model="m").trust_remote_code is False
    assert load_config(ROOT / "configs" / "tiny-cpu.yaml").target.trust_remote_code is False
    from eagle3_pipeline.evaluate.worker import EvalJob
    from eagle3_pipeline.extract.worker import ExtractJob

    for job in (ExtractJob, EvalJob):  # the child jobs carry the configured target itself
        assert job.model_fields["target"].annotation is TargetConfig


# -------------------------------------------------------------------- (d) store confinement

def test_within_refuses_paths_that_leave_the_root(tmp_path):
    from eagle3_pipeline.core.store import within

    root = tmp_path / "store"
    assert within(root, "ds", "v1") == root / "ds" / "v1"
    assert within(str(root) + "/./", "ds/../other") == root / "other"  # normalised, still inside
    for parts in (("..", "x"), ("/etc",), ("ds", "../../x"), ("..",)):
        with pytest.raises(ConfigError, match=r"store path .* leads outside the store root"):
            within(root, *parts)


def test_model_and_dataset_names_cannot_climb_out(tiny_target, tmp_path):
    from eagle3_pipeline.core.store import extract_dir, slug
    from eagle3_pipeline.prepare.stage import prepare

    assert slug("..") == "__" and slug("/models/.") == "_" and slug("org/model-7B") == "model-7B"
    prep_dir = tmp_path / "store" / "ds" / "v1"
    assert extract_dir(prep_dir, "/models/..", "k1") == prep_dir / "__" / "k1"
    # a config that skipped validation (model_construct) is still confined by the store itself
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"id": f"g{i}", "messages": [{"role": "user", "content": f"{i}?"},
                                                                   {"role": "assistant", "content": f"{i}."}]}) + "\n"
                           for i in range(4)))
    cfg = PrepareConfig.model_construct(**{**PrepareConfig(sources=[SourceConfig(path=str(src))], heldout_rows=0)
                                           .__dict__, "dataset": "../../outside"})
    res = prepare(cfg, TargetConfig(model=str(tiny_target)), tmp_path / "store" / "root", log=lambda m: None)
    assert Path(res.dir).is_relative_to(tmp_path / "store" / "root")
    assert not (tmp_path / "outside").exists() and not (tmp_path / "store" / "outside").exists()
    with pytest.raises(ConfigError, match="prepare.dataset: '../../outside' is not a plain directory name"):
        load_config(ROOT / "configs" / "tiny-cpu.yaml", ["prepare.dataset=../../outside"])


# --------------------------------------------------------------------------- (e) hub token

def _hub_config(tmp_path: Path, tiny_target: Path, *extra: str):
    src = tmp_path / "local.jsonl"
    src.write_text("".join(json.dumps({"id": f"g{i}", "messages": [{"role": "user", "content": f"{i}?"},
                                                                   {"role": "assistant", "content": f"{i}."}]}) + "\n"
                           for i in range(4)))
    return load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        f"store={tmp_path / 'store'}", f"target.model={tiny_target}", "prepare.heldout_rows=0",
        f"prepare.sources=[{{path: {src}}}, {{path: someorg/private-chats, revision: v1}}]", *extra])


def test_hub_token_is_never_logged_or_written(tiny_target, tmp_path, monkeypatch, caplog, capfd):
    """prepare with a hub source (offline here, so it fails with its clear error) and a token in the
    environment: the token is in no log line, no output, no error text, no file of the store."""
    from eagle3_pipeline.core.errors import chain
    from eagle3_pipeline.data.formats import SourceError
    from eagle3_pipeline.pipeline.stages import stage_prepare
    from flows.cli import app

    token = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _hub_config(tmp_path, tiny_target)
    lines: list[str] = []
    caplog.set_level(logging.DEBUG)
    with pytest.raises(SourceError) as ei:
        stage_prepare(cfg, log=lines.append)
    assert "someorg/private-chats" in str(ei.value) and "revision 'v1'" in str(ei.value)
    errors = [f"{type(e).__name__}: {e!s} {e!r}" for e in chain(ei.value)]
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    res = CliRunner().invoke(app, ["prepare", "-c", str(cfg_file)])  # the same config through the command
    assert res.exit_code == 3 and "someorg/private-chats" in res.stderr
    out, err = capfd.readouterr()
    written = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert any(p.name == "rows.parquet" for p in written)  # the local source's chunk was written first
    texts = {"log": "\n".join(lines), "logging": caplog.text, "stdout": out + res.stdout, "stderr": err + res.stderr,
             "errors": "\n".join(errors), **{str(p): p.read_bytes().decode("latin-1") for p in written}}
    assert [k for k, v in texts.items() if token in v] == []


def test_configured_token_variable_reaches_the_hub_call(tiny_target, tmp_path, monkeypatch):
    """target.hub_token_env names the variable; the core hands its value to the hub loader (the hub
    itself is unreachable here, so datasets.load_dataset is replaced by a recorder that fails)."""
    import datasets

    from eagle3_pipeline.core.config import hub_token
    from eagle3_pipeline.data.formats import SourceError
    from eagle3_pipeline.prepare.stage import prepare

    token = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("ORG_HUB_TOKEN", token)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cfg = _hub_config(tmp_path, tiny_target, "target.hub_token_env=ORG_HUB_TOKEN")
    assert hub_token(cfg.target) == token and hub_token(TargetConfig(model="m")) is None
    seen = {}

    def load_dataset(name, **kw):
        seen.update(kw, name=name)
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(SourceError) as ei:
        prepare(cfg.prepare, cfg.target, Path(cfg.store), log=lambda m: None)
    assert seen == {"name": "someorg/private-chats", "split": "train", "revision": "v1", "token": token}
    assert token not in str(ei.value)


def test_secret_block_goes_into_the_environment_not_the_log(tmp_path, monkeypatch):
    """The flow layer's resolution of `target.hub_token_secret` (a Prefect server is not started in
    unit tests: the block's `load` is replaced by one that returns the stored value)."""
    from prefect.blocks import system

    from flows.hub_auth import use_hub_secret

    token = f"hf_{uuid.uuid4().hex}"

    class Stored:
        def get(self):
            return token

    loads = []
    monkeypatch.setattr(system.Secret, "load", classmethod(lambda cls, name: loads.append(name) or Stored()))
    monkeypatch.delenv("ORG_HUB_TOKEN", raising=False)
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["target.hub_token_env=ORG_HUB_TOKEN",
                                                            "target.hub_token_secret=hf-token"])
    lines: list[str] = []
    assert use_hub_secret(cfg, log=lines.append) is True
    assert os.environ["ORG_HUB_TOKEN"] == token and loads == ["hf-token"]
    assert lines == ["hub token: from Secret block 'hf-token' into $ORG_HUB_TOKEN"]
    assert token not in json.dumps(cfg.model_dump(mode="json"))
    # a token already in the environment wins; the block is not read again
    assert use_hub_secret(cfg, log=lines.append) is False and loads == ["hf-token"]
    monkeypatch.delenv("ORG_HUB_TOKEN")
