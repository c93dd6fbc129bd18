"""Every manifest under infra/k8s/ and the Jobs of a Kimi-K2.5 run validate against the Kubernetes API schemas
that kubernetes-validate ships (offline; strict: an unknown or misplaced field fails), for the oldest and newest
Kubernetes versions this setup supports. The run's Jobs are rendered by prefect-kubernetes' own worker code from
the pools' job templates with `jobs.job_variables(kimi config, stage)`: four extract groups, verify (a CPU
pod), train and evaluate, and they must request what the config implies. Also: the worker's Role is exactly
what the worker needs, and infra/k8s/prefect.yaml's deployments name pools that infra/k8s/pools.sh creates.
The manifests are rendered the way docs/kubernetes.md renders them: infra/k8s/render.sh with
cluster.env.example as the cluster's settings, and the variables the steps export. The newcomer's walk is
checked too: one pull-secret name, every pod placed, no pod that talks to localhost, every Secret created by a
step, the run command naming a real flow and deployment, the run directory copied back, Prefect pinned."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                                          "(the test extra: pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
IMAGE = "registry.example/eagle3-pipeline@sha256:" + "0123456789abcdef" * 4
EXAMPLE_ENV = K8S / "cluster.env.example"
# what docs/kubernetes.md's steps export beside cluster.env (step 1: the image; step 5: the model to stage)
STEP_VARS = {"EAGLE3_IMAGE": IMAGE, "MODEL_REPO": "moonshotai/Kimi-K2.5", "MODEL_REVISION": "main",
             "MODEL_DIR": "Kimi-K2.5"}
# a cluster whose CPU nodes are a tainted pool of their own: every pod of the manifests must land there
CPU_PLACEMENT = {"EAGLE3_CPU_NODE_SELECTOR": '{"eagle3/pool": "cpu"}',
                 "EAGLE3_CPU_TOLERATIONS": '[{"key": "eagle3/cpu", "operator": "Exists", "effect": "NoSchedule"}]'}
NOT_MANIFESTS = {"prefect.yaml"}  # a Prefect deployment file, not a Kubernetes object
PULL_SECRET = "eagle3-registry"
PREFECT_PINS = {"prefect": "3.7.7", "prefect-kubernetes": "0.7.11"}
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")


def manifest_files() -> list[Path]:
    files = sorted(p for p in K8S.glob("*.yaml") if p.name not in NOT_MANIFESTS)
    assert files, "no manifests under infra/k8s/"
    return files


def render(path: Path, env_file: Path = EXAMPLE_ENV, **exported: str) -> subprocess.CompletedProcess:
    """`bash infra/k8s/render.sh <path>` as docs/kubernetes.md runs it: the cluster's settings from `env_file`, and
    nothing else from this machine's environment but what the steps export (so a variable neither sets fails)."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "EAGLE3_CLUSTER_ENV": str(env_file),
           **exported}
    return subprocess.run(["bash", str(K8S / "render.sh"), str(path)], env=env, capture_output=True, text=True)


@functools.cache
def _rendered(name: str, placed: bool) -> str:
    out = render(K8S / name, **STEP_VARS, **(CPU_PLACEMENT if placed else {}))
    assert out.returncode == 0, f"{name}: render.sh failed: {out.stderr}"
    return out.stdout


def load_manifests(path: Path, placed: bool = True) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(_rendered(path.name, placed)) if d is not None]
    assert docs, f"{path.name}: no documents"
    return docs


def validate(doc: dict, where: str) -> None:
    from eagle3_pipeline.core.cluster import value_problems

    assert value_problems(doc) == [], f"{where}: values the schema accepts but Kubernetes refuses"
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} ({doc.get('kind')}) is not a valid Kubernetes {version} object: {e.message} "
                        f"at {'.'.join(map(str, e.path))}")


@pytest.mark.parametrize("placed", [True, False], ids=["cpu-pool", "example"])
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates(path, placed):
    """Rendered with cluster.env.example's own values (any node) and with a tainted CPU pool's placement."""
    for doc in load_manifests(path, placed):
        validate(doc, path.name)
        assert doc["metadata"].get("namespace", "eagle3") == "eagle3" or doc["kind"] == "Namespace"


def _objects() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in manifest_files() for d in load_manifests(p)}


def test_the_pieces_docs_kubernetes_md_names_are_all_there():
    objs = _objects()
    store = objs["PersistentVolumeClaim", "eagle3-store"]
    models = objs["PersistentVolumeClaim", "models"]
    assert store["spec"]["accessModes"] == ["ReadWriteMany"] == models["spec"]["accessModes"]
    assert {("Namespace", "eagle3"), ("Secret", "hf-token"), ("Secret", "prefect-auth"),
            ("ServiceAccount", "eagle3-worker"), ("ServiceAccount", "eagle3-job"), ("Role", "eagle3-worker"),
            ("RoleBinding", "eagle3-worker"), ("Deployment", "eagle3-worker"), ("Job", "stage-model"),
            ("ServiceAccount", "eagle3-controller"), ("RoleBinding", "eagle3-controller"), ("Pod", "eagle3-data"),
            ("Deployment", "prefect-server"), ("StatefulSet", "eagle3-postgres"), ("Secret", "prefect-db")} <= set(objs)
    data = objs["Pod", "eagle3-data"]["spec"]  # the data pod: the store, as the stage pods' user, no token
    assert data["securityContext"]["runAsUser"] == 10001 and data["automountServiceAccountToken"] is False
    assert data["volumes"][0]["persistentVolumeClaim"]["claimName"] == "eagle3-store"
    for (kind, name), d in objs.items():
        if kind == "Secret":  # templates only: no value that could be a real one
            assert all(v.startswith("REPLACE_") for v in d["stringData"].values()), name
    staging = objs["Job", "stage-model"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in staging["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "0"  # the one pod that reaches the hub
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token", "optional": True}


def test_worker_role_allows_exactly_what_the_kubernetes_worker_needs():
    objs = _objects()
    rules = {(g, r): set(rule["verbs"]) for rule in objs["Role", "eagle3-worker"]["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
                     ("", "pods"): {"get", "list", "watch"}, ("", "pods/log"): {"get"},
                     ("", "events"): {"get", "list", "watch", "create", "patch"}}
    assert not any(k == "ClusterRole" for k, _ in objs)
    binding = objs["RoleBinding", "eagle3-worker"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "eagle3-worker", "namespace": "eagle3"}]
    pod = objs["Deployment", "eagle3-worker"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "eagle3-worker"
    pools = set()
    for c in pod["containers"]:
        env = {e["name"]: e for e in c["env"]}
        # namespaced observer (the Role is namespaced) and the auth string as a secretKeyRef in the Jobs
        assert env["PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES"]["value"] == "eagle3"
        assert env["PREFECT_API_AUTH_STRING"]["valueFrom"]["secretKeyRef"]["name"] == "prefect-auth"
        assert env["PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_NAME"]["value"] == "prefect-auth"
        pools.add(c["command"][c["command"].index("--pool") + 1])
    assert pools == {"eagle3-gpu", "eagle3-cpu"}
    assert objs["ServiceAccount", "eagle3-job"]["automountServiceAccountToken"] is False


# ------------------------------------------------------------------ the Jobs of a Kimi run


@pytest.fixture(scope="module")
def kimi():
    from eagle3_pipeline.core.config import load_config

    return load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml")


def kimi_run_jobs(cfg, given: dict | None = None) -> dict[str, tuple[dict, dict]]:
    """name -> (job variables, rendered Job) of one Kimi run: 100 shards in 4 groups, verify, train, evaluate."""
    pytest.importorskip("prefect_kubernetes")
    from eagle3_pipeline.pipeline.jobs import job_variables
    from tests.unit.test_k8s_job_template import CPU_TEMPLATE, TEMPLATE, render

    assert cfg.extract.parallel_groups == 4
    jobs = {}
    stages = [(f"extract-{g}", "extract", 25, "extract-group") for g in range(4)]
    stages += [("verify", "verify", None, "verify-stage"), ("train", "train", None, "train-stage"),
               ("evaluate", "evaluate", None, "evaluate-stage")]
    for name, stage, shards, flow in stages:
        jv = {"image": IMAGE, **job_variables(cfg, stage, shards), **(given or {})}
        template = TEMPLATE if jv["gpu_count"] else CPU_TEMPLATE
        jobs[name] = (jv, render(jv, template, flow))
    return jobs


def test_kimi_run_jobs_validate_and_request_what_the_config_implies(kimi):
    from eagle3_pipeline.pipeline.jobs import stage_deadline_s

    jobs = kimi_run_jobs(kimi)
    assert len([n for n in jobs if n.startswith("extract-")]) == 4
    for name, (jv, job) in jobs.items():
        validate(job, f"the {name} Job")
        (c,) = job["spec"]["template"]["spec"]["containers"]
        gpus = c["resources"]["limits"].get("nvidia.com/gpu", 0)
        stage = name.split("-")[0]
        want = {"extract": kimi.extract.tensor_parallel_size, "train": kimi.train.world_size,
                "evaluate": kimi.evaluate.tensor_parallel_size, "verify": 0}[stage]
        assert gpus == want == (8 if stage != "verify" else 0), name
        assert c["resources"]["requests"].get("nvidia.com/gpu", 0) == gpus
        deadline = job["spec"]["activeDeadlineSeconds"]
        own = stage_deadline_s(kimi, stage, 25 if stage == "extract" else None)
        assert deadline == jv["deadline_seconds"] > own, name
        assert c["resources"]["requests"]["memory"] == jv["memory_request"]
        assert c["image"] == IMAGE
    # the config's own deadlines, each strictly inside its Job's
    assert jobs["extract-0"][1]["spec"]["activeDeadlineSeconds"] > kimi.extract.start_timeout_s + 25 * kimi.extract.shard_timeout_s
    assert jobs["train"][1]["spec"]["activeDeadlineSeconds"] > kimi.train.timeout_s
    assert jobs["evaluate"][1]["spec"]["activeDeadlineSeconds"] > kimi.evaluate.timeout_s
    assert jobs["verify"][1]["spec"]["activeDeadlineSeconds"] > kimi.verify.reference_timeout_s
    mem = jobs["verify"][1]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert int(mem.removesuffix("Gi")) > kimi.verify.reference_memory_gb


def test_kimi_run_jobs_carry_tolerations_service_account_and_pull_secrets_when_given(kimi):
    given = {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "eagle3", "effect": "NoSchedule"}],
             "service_account_name": "eagle3-runner", "image_pull_secrets": [{"name": PULL_SECRET}],
             "cpu_limit": "96"}
    for name, (_, job) in kimi_run_jobs(kimi, given).items():
        validate(job, f"the {name} Job")
        pod = job["spec"]["template"]["spec"]
        assert pod["tolerations"] == given["tolerations"], name
        assert pod["serviceAccountName"] == "eagle3-runner" and pod["automountServiceAccountToken"] is False
        assert pod["imagePullSecrets"] == [{"name": PULL_SECRET}]
        assert pod["containers"][0]["resources"]["limits"]["cpu"] == "96"


def test_a_broken_job_fails_validation(kimi):
    """The schemas are strict: a field in the wrong place (what the old template had: parallelism in the pod
    spec) or a wrong type is caught."""
    (_, job) = kimi_run_jobs(kimi)["train"]
    job["spec"]["template"]["spec"]["parallelism"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSIONS[0], strict=True)


def test_every_service_account_carries_the_registry_pull_secret():
    """A private registry's pull secret reaches the worker, every stage Job, the pipeline's pod, the data pod and
    the model-staging Job: each runs as a ServiceAccount that names it (Kubernetes adds an account's
    imagePullSecrets to its pods)."""
    objs = _objects()
    for sa in ("eagle3-worker", "eagle3-job", "eagle3-controller"):
        assert objs[("ServiceAccount", sa)]["imagePullSecrets"] == [{"name": PULL_SECRET}], sa
    staging = next(d for (k, n), d in objs.items() if k == "Job")
    assert staging["spec"]["template"]["spec"]["serviceAccountName"] == "eagle3-job"
    worker = objs[("Deployment", "eagle3-worker")]["spec"]["template"]["spec"]
    assert worker["serviceAccountName"] == "eagle3-worker"


def test_values_the_schema_accepts_but_kubernetes_refuses_are_named(kimi):
    """kubernetes-validate passes `memory: 512GiB`, `cpu: sixty-four` and an image name with spaces
    (structure only); cluster.value_problems names each, with where it is."""
    from eagle3_pipeline.core.cluster import value_problems

    (_, job) = kimi_run_jobs(kimi)["train"]
    c = job["spec"]["template"]["spec"]["containers"][0]
    c["resources"]["limits"]["memory"], c["resources"]["requests"]["cpu"] = "512GiB", "sixty-four"
    c["image"] = "my registry/eagle3 pipeline:latest"
    kubernetes_validate.validate(job, KUBERNETES_VERSIONS[0], strict=True)  # the schema accepts all three
    found = value_problems(job)
    assert any("limits.memory: '512GiB' is not a Kubernetes quantity" in p for p in found), found
    assert any("requests.cpu: 'sixty-four' is not a Kubernetes quantity" in p for p in found), found
    assert any("image: 'my registry/eagle3 pipeline:latest' is not an image reference" in p for p in found), found
    job["metadata"]["generateName"] = "Eagle3_Extract-"
    assert any("generateName: 'Eagle3_Extract-' is not a valid Kubernetes name" in p for p in value_problems(job))


# ------------------------------------------------------------------ infra/k8s/prefect.yaml


def test_kubernetes_deployments_name_the_pools_pools_sh_creates_and_flows_that_exist():
    spec = yaml.safe_load((K8S / "prefect.yaml").read_text())
    pools_sh = (K8S / "pools.sh").read_text()
    created = dict(re.findall(r"work-pool create (\S+) --type kubernetes --base-job-template \"\$placed/(\w+)\.json\"", pools_sh))
    assert created == {"eagle3-gpu": "gpu", "eagle3-cpu": "cpu"}
    # each from the repository's template with this cluster's placement (place.py)
    assert 'place.py" template "$infra/k8s-$kind-job-template.json" "$kind" > "$placed/$kind.json"' in pools_sh
    created = {k: f"k8s-{v}-job-template.json" for k, v in created.items()}
    assert all((ROOT / "infra" / t).is_file() for t in created.values())
    assert "set-concurrency-limit eagle3-gpu" in pools_sh
    steps = [next(iter(s.values())) for s in spec["build"] + spec["push"]]
    assert [s["id"] for s in steps] == ["build-image", "push-image"]
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {"pipeline-k8s", "extract-group-k8s", "verify-stage-k8s", "train-stage-k8s", "evaluate-stage-k8s"}
    process = {d["name"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    assert not set(deps) & process, "a name in both files would move a deployment between pools"
    pools = {"extract-group-k8s": "eagle3-gpu", "train-stage-k8s": "eagle3-gpu", "evaluate-stage-k8s": "eagle3-gpu",
             "verify-stage-k8s": "eagle3-cpu", "pipeline-k8s": "eagle3-cpu"}
    for name, d in deps.items():
        assert d["work_pool"]["name"] == pools[name] and d["work_pool"]["name"] in created
        assert d["work_pool"]["job_variables"]["image"] == "{{ push-image.stdout }}"  # pinned by digest
        path, func = d["entrypoint"].split(":")
        tree = ast.parse((ROOT / path).read_text())
        assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, d["entrypoint"]
    # the pipeline pod's targets are this file's deployments: <flow name>/<deployment name>
    env = deps["pipeline-k8s"]["work_pool"]["job_variables"]["env"]
    flows = {name: d["entrypoint"].split(":")[1].replace("_", "-") for name, d in deps.items()}
    assert env["EAGLE3_EXTRACT_GROUP_DEPLOYMENT"] == f"{flows['extract-group-k8s']}/extract-group-k8s"
    for stage in ("verify", "train", "evaluate"):
        assert env["EAGLE3_STAGE_DEPLOYMENT"].format(stage=stage) == f"{flows[stage + '-stage-k8s']}/{stage}-stage-k8s"
    assert deps["pipeline-k8s"]["parameters"]["output_dir"].startswith("/data/")  # on the store, not the pod


def test_pipeline_k8s_default_run_is_the_kimi_config_with_its_stages_as_deployments(monkeypatch):
    """What a run of pipeline-k8s with its default parameters resolves to, the way a worker's pod would (the
    image's working directory is this checkout's layout): the Kimi config, stages as deployments, 4 groups."""
    pytest.importorskip("prefect")
    from prefect.flows import load_flow_from_entrypoint

    from flows.config_param import resolve_config, switches

    (dep,) = [d for d in yaml.safe_load((K8S / "prefect.yaml").read_text())["deployments"] if d["name"] == "pipeline-k8s"]
    monkeypatch.chdir(ROOT)
    p = load_flow_from_entrypoint(dep["entrypoint"]).validate_parameters(dep["parameters"])
    cfg = resolve_config(p["config"], p["config_path"], switches(overrides=p["overrides"]))
    assert cfg.name == "kimi-k2.5-tp8" and cfg.gpu_stages == "deployments" and cfg.extract.parallel_groups == 4
    assert cfg.store.startswith("/data/") and cfg.target.model.startswith("/models/")  # the two volumes' mounts


# ------------------------------------------------------------------ issue 41: the pods a drain must not take

def test_gpu_jobs_are_not_disrupted_and_the_controller_reads_its_pods(kimi):
    """Every stage Job's pod: do-not-disrupt annotations (Karpenter, cluster-autoscaler), a termination grace
    for the shard in flight, a priority class that exists (priority.yaml); the pipeline's own pod runs as
    eagle3-controller with its token (pods get/list, jobs get/list/delete: flows/pods.py, nothing more), ranks
    above the GPU Jobs and is rescheduled, not crashed, by SIGTERM."""
    objs = _objects()
    classes = {name for (kind, name) in objs if kind == "PriorityClass"}
    assert classes == {"eagle3-gpu", "eagle3-control"}
    assert objs["PriorityClass", "eagle3-control"]["value"] > objs["PriorityClass", "eagle3-gpu"]["value"] > 0
    for name, (jv, job) in kimi_run_jobs(kimi).items():
        pod = job["spec"]["template"]
        ann = pod["metadata"]["annotations"]
        assert ann["karpenter.sh/do-not-disrupt"] == "true", name
        assert ann["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false", name
        assert pod["spec"]["priorityClassName"] in classes, name
        assert pod["spec"]["terminationGracePeriodSeconds"] >= 120, name
        assert pod["spec"]["automountServiceAccountToken"] is False, name  # stage pods: no Kubernetes API
    role = objs["Role", "eagle3-controller"]
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]} == {
        (("",), ("pods",)): {"get", "list"}, (("batch",), ("jobs",)): {"get", "list", "delete"}}
    (dep,) = [d for d in yaml.safe_load((K8S / "prefect.yaml").read_text())["deployments"] if d["name"] == "pipeline-k8s"]
    jv = dep["work_pool"]["job_variables"]
    assert jv["service_account_name"] == "eagle3-controller" and jv["automount_service_account_token"] is True
    assert jv["priority_class"] == "eagle3-control"
    assert jv["env"]["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "reschedule"


def test_the_server_keeps_its_state():
    """prefect-server.yaml: the server pinned to the flows' Prefect, one replica on a PREFECT_HOME volume with the
    filesystem lease storage, PostgreSQL on a volume, basic auth and the database password from Secrets."""
    import re

    objs = _objects()
    server = objs["Deployment", "prefect-server"]
    (c,) = server["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"prefecthq/prefect:3\.7\.7-python3\.\d+", c["image"])
    assert server["spec"]["replicas"] == 1 and server["spec"]["strategy"]["type"] == "Recreate"
    env = {e["name"]: e for e in c["env"]}
    assert env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"]["value"].endswith("lease_storage.filesystem")
    home = env["PREFECT_HOME"]["value"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == home]
    vols = {v["name"]: v for v in server["spec"]["template"]["spec"]["volumes"]}
    assert ("PersistentVolumeClaim", vols[mount["name"]]["persistentVolumeClaim"]["claimName"]) in objs
    assert env["PREFECT_SERVER_API_AUTH_STRING"]["valueFrom"]["secretKeyRef"] == {"name": "prefect-auth",
                                                                                  "key": "auth-string"}
    assert "$(PREFECT_DB_PASSWORD)" in env["PREFECT_API_DATABASE_CONNECTION_URL"]["value"]
    pg = objs["StatefulSet", "eagle3-postgres"]
    (pc,) = pg["spec"]["template"]["spec"]["containers"]
    claim = pg["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objs and pc["image"].startswith("postgres:16")
    secrets = yaml.safe_load_all((K8S / "secrets.template.yaml").read_text())
    assert {"prefect-auth", "prefect-db"} <= {s["metadata"]["name"] for s in secrets}


# ------------------------------------------------------------------ issue 52: the cluster a newcomer can run

GPU_BLOCKS = ("NVIDIA GPU operator", "GKE", "EKS")


def example_block(block: str) -> dict[str, str]:
    """The GPU placement of one platform block of cluster.env.example (its lines, commented out or not)."""
    text = EXAMPLE_ENV.read_text()
    chosen = text.split(f"# --- {block}")[1].split("# ---")[0]
    return {k: v.strip("'") for line in chosen.splitlines() if re.match(r"(# )?EAGLE3_GPU_", line)
            for k, _, v in [line.removeprefix("# ").partition("=")]}


def run_pools(tmp_path: Path, env_file: Path = EXAMPLE_ENV, **exported: str):
    """infra/k8s/pools.sh with a `prefect` on PATH that records its calls and keeps each pool's base job template:
    ({pool: template}, [call, ...]), or the failed process."""
    bin_dir, out = tmp_path / "bin", tmp_path / "pools"
    bin_dir.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    fake = bin_dir / "prefect"
    fake.write_text('#!/usr/bin/env bash\necho "$*" >> "$FAKE_OUT/calls"\n'
                    'for ((i = 1; i < $#; i++)); do [[ ${!i} == --base-job-template ]] && j=$((i + 1)) && '
                    'cp "${!j}" "$FAKE_OUT/$3.json"; done; exit 0\n')
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/tmp"),
           "EAGLE3_CLUSTER_ENV": str(env_file), "FAKE_OUT": str(out), **exported}
    p = subprocess.run(["bash", str(K8S / "pools.sh")], env=env, capture_output=True, text=True)
    if p.returncode:
        return p
    calls = (out / "calls").read_text().splitlines()
    return {pool: json.loads((out / f"{pool}.json").read_text()) for pool in ("eagle3-gpu", "eagle3-cpu")}, calls


def _pod_specs(objs: dict) -> dict[str, dict]:
    """Every pod spec of the manifests, by object: a Pod's own, a Job's, Deployment's or StatefulSet's template."""
    out = {}
    for (kind, name), d in objs.items():
        if kind == "Pod":
            out[f"{kind}/{name}"] = d["spec"]
        elif kind in ("Job", "Deployment", "StatefulSet"):
            out[f"{kind}/{name}"] = d["spec"]["template"]["spec"]
    return out


def _in_cluster_api_url(objs: dict) -> str:
    """The API as pods reach it: prefect-server.yaml's Service, by its cluster DNS name."""
    svc = objs["Service", "prefect-server"]
    pod = objs["Deployment", "prefect-server"]["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    return f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:{port['port']}/api"


@pytest.mark.parametrize("block", GPU_BLOCKS)
def test_pools_place_pods_from_one_env_file(block, tmp_path):
    """pools.sh's templates take cluster.env's node placement (each platform block of cluster.env.example, exported
    over the file: what the caller exports wins), the in-cluster API URL and the GPU pool's facts for preflight as
    their defaults, and the Job prefect-kubernetes renders carries them; the GPU pool's limit is EAGLE3_GPU_NODES."""
    pytest.importorskip("prefect_kubernetes")
    from tests.unit.test_k8s_job_template import render as render_job

    chosen = example_block(block)
    templates, calls = run_pools(tmp_path, **chosen)
    assert "work-pool set-concurrency-limit eagle3-gpu 4" in calls  # EAGLE3_GPU_NODES=4 in the example
    objs = _objects()
    for pool, flow in (("eagle3-gpu", "extract-group"), ("eagle3-cpu", "pipeline")):
        (tmp_path / f"{pool}.json").write_text(json.dumps(templates[pool]))
        job = render_job({"image": IMAGE}, tmp_path / f"{pool}.json", flow)
        validate(job, f"the {flow} Job of {block}")
        spec = job["spec"]["template"]["spec"]
        if pool == "eagle3-gpu":
            assert spec["nodeSelector"] == json.loads(chosen["EAGLE3_GPU_NODE_SELECTOR"])
            assert spec["tolerations"] == json.loads(chosen["EAGLE3_GPU_TOLERATIONS"])
        else:
            assert spec["nodeSelector"] == {} and spec["tolerations"] == []  # the example's CPU placement: any node
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        # the worker rendering it talks to http://127.0.0.1:9/api; the pod is given the in-cluster Service
        assert env["PREFECT_API_URL"] == _in_cluster_api_url(objs)
        assert json.loads(env["EAGLE3_GPU_NODE_SELECTOR"]) == json.loads(chosen["EAGLE3_GPU_NODE_SELECTOR"])
        assert env["EAGLE3_GPUS_PER_NODE"] == "8"


def test_scripts_refuse_a_bad_setting_naming_it(tmp_path):
    """A selector that is not a JSON object, or an API URL on localhost (inside a pod: the pod itself), stops
    pools.sh and render.sh before anything is applied, naming the variable."""
    bad = run_pools(tmp_path, EAGLE3_CPU_NODE_SELECTOR="pool=cpu")
    assert isinstance(bad, subprocess.CompletedProcess) and bad.returncode != 0
    assert "EAGLE3_CPU_NODE_SELECTOR" in bad.stderr
    for url in ("http://localhost:4200/api", "http://127.0.0.1:4200/api"):
        out = render(K8S / "worker.yaml", **STEP_VARS, EAGLE3_CLUSTER_API_URL=url)
        assert out.returncode != 0 and "EAGLE3_CLUSTER_API_URL" in out.stderr and not out.stdout
    out = render(K8S / "worker.yaml")  # step 1's EAGLE3_IMAGE not exported: named, nothing printed
    assert out.returncode != 0 and "EAGLE3_IMAGE" in out.stderr and not out.stdout


def test_every_script_that_reads_cluster_env_names_the_step_that_makes_it(tmp_path):
    """cluster.env exists only as cluster.env.example in the repository: docs/kubernetes.md copies it (step 0), and
    every script that reads it stops, saying how to make it, when it is missing."""
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "cp infra/k8s/cluster.env.example infra/k8s/cluster.env" in doc
    assert "infra/k8s/cluster.env" in (ROOT / ".gitignore").read_text().split()
    readers = [p for p in sorted((ROOT / "infra").rglob("*.sh")) if "cluster.env" in p.read_text()
               and p.name != "cluster-env.sh"]  # the loader both source
    assert {p.name for p in readers} == {"pools.sh", "render.sh"}
    assert all('. "$here/cluster-env.sh"' in p.read_text() for p in readers)
    missing = tmp_path / "cluster.env"
    for script in readers:
        args = [str(K8S / "worker.yaml")] if script.name == "render.sh" else []
        p = subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"], "EAGLE3_CLUSTER_ENV": str(missing), **STEP_VARS})
        assert p.returncode == 2 and "cp infra/k8s/cluster.env.example infra/k8s/cluster.env" in p.stderr, script


def test_every_pod_is_placed_from_cluster_env():
    """The server, PostgreSQL, the worker, the data pod and the model-staging Job go where cluster.env's CPU
    placement says (a cluster whose nodes are all tainted would leave them Pending otherwise), like the CPU
    pool's Jobs; the GPU pool's Jobs have their own."""
    objs = _objects()
    pods = _pod_specs(objs)
    assert {"Deployment/prefect-server", "StatefulSet/eagle3-postgres", "Deployment/eagle3-worker", "Pod/eagle3-data",
            "Job/stage-model"} <= set(pods)
    for name, spec in pods.items():
        assert spec.get("nodeSelector") == json.loads(CPU_PLACEMENT["EAGLE3_CPU_NODE_SELECTOR"]), name
        assert spec.get("tolerations") == json.loads(CPU_PLACEMENT["EAGLE3_CPU_TOLERATIONS"]), name
    for kind in ("gpu", "cpu"):
        pod = json.loads((ROOT / "infra" / f"k8s-{kind}-job-template.json").read_text())
        pod = pod["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
        assert (pod["nodeSelector"], pod["tolerations"]) == ("{{ node_selector }}", "{{ tolerations }}"), kind


def test_no_pod_talks_to_localhost():
    """Every in-cluster client gets the server's Service (prefect-server.eagle3.svc.cluster.local), never the
    workstation's port-forward: the worker, both job templates, the deployments' own env; the one localhost
    address is the browser's (PREFECT_UI_API_URL, served to the UI)."""
    objs = _objects()
    url = _in_cluster_api_url(objs)
    place = (K8S / "place.py").read_text()
    assert f'CLUSTER_API_URL = "{url}"' in place
    assert f"\nEAGLE3_CLUSTER_API_URL={url}\n" in EXAMPLE_ENV.read_text()
    seen = 0
    for where, spec in _pod_specs(objs).items():
        for c in spec["containers"]:
            for e in c.get("env", []):
                if e["name"].endswith("API_URL") and e["name"] != "PREFECT_UI_API_URL":
                    host = re.sub(r"^[a-z]+://", "", e["value"]).split("/")[0].rsplit(":", 1)[0]
                    assert host not in LOCAL_HOSTS, (where, e)
                    seen += 1
                    if e["name"] == "PREFECT_API_URL":
                        assert e["value"] == url, where
    assert seen >= 2  # the worker's two containers
    for kind in ("gpu", "cpu"):
        env = json.loads((ROOT / "infra" / f"k8s-{kind}-job-template.json").read_text())
        assert env["variables"]["properties"]["env"]["default"]["PREFECT_API_URL"] == url, kind
    for d in yaml.safe_load((K8S / "prefect.yaml").read_text())["deployments"]:
        for k, v in d["work_pool"]["job_variables"].get("env", {}).items():
            assert not any(h in str(v) for h in LOCAL_HOSTS), (d["name"], k)
    (server,) = objs["Deployment", "prefect-server"]["spec"]["template"]["spec"]["containers"]
    ui = {e["name"]: e.get("value") for e in server["env"]}["PREFECT_UI_API_URL"]
    assert ui == "http://localhost:4200/api"  # step 6's port-forward, from the browser
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "kubectl -n eagle3 port-forward svc/prefect-server 4200:4200" in doc


def test_one_image_pull_secret_name_everywhere():
    """The registry's pull secret has one name in every manifest, template, script and doc: the one the
    ServiceAccounts carry and step 3 creates."""
    objs = _objects()
    names = {s["name"] for (k, _), d in objs.items() if k == "ServiceAccount" for s in d.get("imagePullSecrets", [])}
    names |= {n for (k, n), d in objs.items() if k == "Secret" and d["type"] == "kubernetes.io/dockerconfigjson"}
    patterns = (r"docker-registry\s+([\w.$-]+)", r"imagePullSecrets:[^\n]*\n\s*- name: ([\w.${}-]+)",
                r"image_pull_secrets[^\n]*?name\W+([\w.$-]+)", r"IMAGE_PULL_SECRET\w*=([\w.-]+)")
    files = [p for p in (ROOT / "infra").rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".sh", ".py",
             ".example", ".md")] + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    for p in files:
        text = p.read_text()
        for pat in patterns:
            names |= {f"{m} ({p.relative_to(ROOT)})" if m != PULL_SECRET else m for m in re.findall(pat, text)}
    assert names == {PULL_SECRET}
    assert "EAGLE3_IMAGE_PULL_SECRET" not in (K8S / "place.py").read_text()  # no second way to name it


def _referenced_secrets(objs: dict) -> set[str]:
    def refs(o):
        if isinstance(o, dict):
            if "secretKeyRef" in o:
                yield o["secretKeyRef"]["name"]
            for v in o.values():
                yield from refs(v)
        elif isinstance(o, list):
            for v in o:
                yield from refs(v)

    names = {n for (k, _), d in objs.items() if k != "Secret" for n in refs(d)}
    names |= {s["name"] for (k, _), d in objs.items() if k == "ServiceAccount" for s in d.get("imagePullSecrets", [])}
    for spec in _pod_specs(objs).values():  # the worker's: the Secret it hands every Job as a secretKeyRef
        for c in spec["containers"]:
            names |= {e["value"] for e in c.get("env", []) if e["name"].endswith("_SECRET_NAME")}
    for kind in ("gpu", "cpu"):
        t = json.loads((ROOT / "infra" / f"k8s-{kind}-job-template.json").read_text())
        names.add(t["variables"]["properties"]["hf_token_secret"]["default"])
    return names


def test_every_secret_a_manifest_names_is_created_by_a_documented_step():
    """prefect-db, prefect-auth, hf-token, eagle3-registry: each Secret a pod reads, a ServiceAccount names or a
    job template defaults to has a `kubectl create secret` in step 3 and a template in secrets.template.yaml."""
    objs = _objects()
    referenced = _referenced_secrets(objs)
    assert {"prefect-db", "prefect-auth", "hf-token", PULL_SECRET} <= referenced
    templates = {d["metadata"]["name"] for d in yaml.safe_load_all((K8S / "secrets.template.yaml").read_text())}
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    step3 = doc.split("## 3. Secrets")[1].split("\n## ")[0]
    for name in referenced:
        assert name in templates, f"secret {name}: not in infra/k8s/secrets.template.yaml"
        assert re.search(rf"kubectl -n eagle3 create secret [\w-]+ {re.escape(name)}\b", step3), \
            f"secret {name}: no `kubectl create secret` in docs/kubernetes.md step 3"


def _flow_names() -> dict[str, str]:
    """entrypoint -> the @flow's name (its `name=`, else the function's name with '-' for '_')."""
    out = {}
    for path in sorted((ROOT / "flows").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "flow":
                        kw = {k.arg: k.value for k in dec.keywords}
                        name = kw["name"].value if "name" in kw else node.name.replace("_", "-")
                        out[f"flows/{path.name}:{node.name}"] = name
    return out


def test_the_run_commands_in_the_docs_name_a_flow_and_its_deployment():
    """`prefect deployment run <flow>/<deployment>` in every doc and script names a deployment of one of the two
    prefect.yaml files together with the name of its entrypoint's flow (`pipeline`, not `pipeline-k8s`)."""
    flows = _flow_names()
    known = set()
    for spec in (ROOT / "prefect.yaml", K8S / "prefect.yaml"):
        for d in yaml.safe_load(spec.read_text())["deployments"]:
            known.add(f"{flows[d['entrypoint']]}/{d['name']}")
    assert "pipeline/pipeline-k8s" in known
    found = {}
    for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", *sorted((ROOT / "infra").rglob("*.sh")),
              *sorted((ROOT / "infra").rglob("*.yaml"))]:
        for m in re.findall(r"prefect deployment run\s+[\"']?([\w.-]+/[\w.-]+)", p.read_text()):
            found[m] = p.relative_to(ROOT)
    assert "pipeline/pipeline-k8s" in found, "docs/kubernetes.md runs the pipeline-k8s deployment"
    assert {m: where for m, where in found.items() if m not in known} == {}


def test_a_run_directory_is_copied_back_not_its_link(tmp_path):
    """runs/latest is a symbolic link: `kubectl cp` of it copies the link and nothing else. The docs and the data
    pod's header resolve it in the pod (readlink -f) and copy the directory it names."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.report.runs import create_run_dir

    run = create_run_dir(tmp_path / "runs", load_config(ROOT / "configs" / "tiny-cpu.yaml"))
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink()  # what the pod holds
    resolved = subprocess.run(["readlink", "-f", str(latest)], capture_output=True, text=True, check=True).stdout
    assert resolved.strip() == str(run) and (Path(resolved.strip()) / "config.json").is_file()
    for p in (ROOT / "docs" / "kubernetes.md", K8S / "data-pod.yaml"):
        text = p.read_text()
        assert not re.search(r"kubectl\b[^\n]*\bcp\b[^\n]*runs/latest", text), p.name
        assert "readlink -f /data/runs/latest)" in text and 'cp "eagle3-data:$run"' in text, p.name


def test_prefect_is_pinned_exactly_on_the_cluster():
    """Every Prefect on the cluster is 3.7.7 with prefect-kubernetes 0.7.11 (the last that installs beside vLLM's
    fastapi pin): the image's lock and its build check, the server's image, the compose server, the deployment
    file; the worker runs the image (no pip install of its own), and no manifest installs anything."""
    lock = (ROOT / "infra" / "requirements-gpu-k8s.lock").read_text()
    for pkg, version in PREFECT_PINS.items():
        assert re.search(rf"^{re.escape(pkg)}=={re.escape(version)} ", lock, re.M), f"{pkg} in the lock"
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text()
    assert f'== ("{PREFECT_PINS["prefect"]}", "{PREFECT_PINS["prefect-kubernetes"]}")' in dockerfile
    assert yaml.safe_load((K8S / "prefect.yaml").read_text())["prefect-version"] == PREFECT_PINS["prefect"]
    compose = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())
    assert compose["services"]["prefect-server"]["image"].startswith(f"prefecthq/prefect:{PREFECT_PINS['prefect']}-")
    objs = _objects()
    (server,) = objs["Deployment", "prefect-server"]["spec"]["template"]["spec"]["containers"]
    assert server["image"].startswith(f"prefecthq/prefect:{PREFECT_PINS['prefect']}-")
    for c in objs["Deployment", "eagle3-worker"]["spec"]["template"]["spec"]["containers"]:
        assert c["image"] == IMAGE and c["command"][0] == "prefect"
    for p in [*K8S.glob("*.yaml"), *(ROOT / "infra").glob("k8s-*-job-template.json")]:
        assert "pip install" not in p.read_text(), p.name


def test_the_pipeline_pod_checks_the_config_against_the_gpu_pool(kimi, tmp_path):
    """What pools.sh gives the CPU pool's pods is what preflight reads there (cluster.gpu_pool_problems): on the
    shipped GPU pool the Kimi config passes; on GKE's H100 nodes its gpu_memory_gib 141 is refused, naming 80."""
    pytest.importorskip("prefect_kubernetes")
    from eagle3_pipeline.core.cluster import gpu_pool_problems
    from tests.unit.test_k8s_job_template import render as render_job

    for selector, refused in ((None, False), ('{"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}', True)):
        templates, _ = run_pools(tmp_path, **({"EAGLE3_GPU_NODE_SELECTOR": selector} if selector else {}))
        (tmp_path / "cpu.json").write_text(json.dumps(templates["eagle3-cpu"]))
        job = render_job({"image": IMAGE}, tmp_path / "cpu.json", "pipeline")
        env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
        problems, warnings = gpu_pool_problems(kimi, env)
        if refused:
            assert problems and all("GPUs of 80 GiB" in p for p in problems) and "141" in problems[0], problems
        else:
            assert (problems, warnings) == ([], [])


# ------------------------------------------------------------------ training on several nodes


def test_kimi_trains_on_a_set_of_four_pods(kimi):
    """configs/kimi-k2.5-tp8.yaml (train.nodes 4) renders the train stage as an Indexed Job of 4 pods of 8 GPUs in the
    headless Service's subdomain, started through the set's launcher, failed whole at its first failed pod; the
    Service selects exactly the pods the template labels. The other stages' Jobs stay one pod."""
    from eagle3_pipeline.pipeline.jobs import NODES_LAUNCHER, TRAIN_SERVICE, TRAIN_SET_LABEL

    jobs = kimi_run_jobs(kimi)
    jv, job = jobs["train"]
    validate(job, "the train set's Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["parallelism"], spec["completions"], spec["completionMode"]) == (4, 4, "Indexed") == \
        (kimi.train.nodes, kimi.train.nodes, "Indexed")
    assert pod["subdomain"] == TRAIN_SERVICE and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["command"] == NODES_LAUNCHER and c["args"] == ["prefect", "flow-run", "execute"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == kimi.train.world_size == 8
    rules = spec["podFailurePolicy"]["rules"]
    assert {r["action"] for r in rules} == {"FailJob"} and spec["backoffLimit"] == 1  # the policy acts first
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    env = {e["name"]: e for e in c["env"]}
    assert env["EAGLE3_TRAIN_RDZV_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/job-name']"
    assert env["EAGLE3_TRAIN_LOCAL_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["EAGLE3_TRAIN_SET_DIR"]["value"].startswith("/data/")  # on the store every pod mounts
    labels = job["spec"]["template"]["metadata"]["labels"]
    service = _objects()["Service", TRAIN_SERVICE]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {TRAIN_SET_LABEL: TRAIN_SERVICE} and labels[TRAIN_SET_LABEL] == TRAIN_SERVICE
    assert service["spec"]["ports"][0]["port"] == kimi.train.rdzv_port
    for name, (_, other) in jobs.items():
        if name != "train":
            o = other["spec"]
            assert (o["parallelism"], o["completions"], o["backoffLimit"]) == (1, 1, 0), name
            assert "completionMode" not in o and "subdomain" not in o["template"]["spec"], name
            assert "command" not in o["template"]["spec"]["containers"][0], name
            assert TRAIN_SET_LABEL not in o["template"]["metadata"].get("labels", {}), name


def test_one_node_training_stays_one_pod(kimi):
    jv, job = kimi_run_jobs(kimi.model_copy(update={"train": kimi.train.model_copy(update={"nodes": 1})}))["train"]
    validate(job, "the one-node train Job")
    assert (job["spec"]["parallelism"], job["spec"]["completions"]) == (1, 1) and "pods" not in jv
    assert "completionMode" not in job["spec"] and "command" not in job["spec"]["template"]["spec"]["containers"][0]


def test_no_account_of_the_pipeline_may_create_services():
    """The train sets' Service is applied once in step 2 (train-service.yaml); no Role grants services."""
    for (kind, name), d in _objects().items():
        if kind == "Role":
            assert not any("services" in rule["resources"] for rule in d["rules"]), name


ENGINE_SET_ARGS = ["--config", "configs/kimi-k2.5-tp8.yaml", "--set", "extract.gpu_memory_gib=80", "--stage",
                   "extract", "--nodes", "2", "--shards", "25", "--image", IMAGE,
                   "--node-selector", '{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}']


@pytest.mark.parametrize("split", ["pp", "tp"])
def test_the_multi_node_engine_set_renders_from_the_config_and_validates(split, monkeypatch):
    """pipeline/engine_sets.py: the Kimi config's extract engine over two 8-GPU H100 nodes (TP 8 x PP 2, or TP 16
    with RDMA): the engine sets' Service, NetworkPolicy and a two-pod Indexed Job, valid for Kubernetes 1.30 and
    1.37, failed whole at its first failed pod, its deadline and requests those of the stage's one-node Job."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.engine import nodes
    from eagle3_pipeline.pipeline.engine_sets import render
    from eagle3_pipeline.pipeline.jobs import job_variables

    monkeypatch.chdir(ROOT)
    docs = list(yaml.safe_load_all(render([*ENGINE_SET_ARGS, "--split", split])))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "NetworkPolicy", "Job"}
    for d in docs:
        validate(d, f"the engine set's {d['kind']} ({split})")
    job, svc, policy = kinds["Job"], kinds["Service"], kinds["NetworkPolicy"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["parallelism"], spec["completions"], spec["completionMode"]) == (2, 2, "Indexed")
    assert {r["action"] for r in spec["podFailurePolicy"]["rules"]} == {"FailJob"}
    assert pod["subdomain"] == svc["metadata"]["name"] == nodes.ENGINE_SERVICE and svc["spec"]["clusterIP"] == "None"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["port"] == nodes.MASTER_PORT
    (c,) = pod["containers"]
    assert c["command"] == nodes.NODES_LAUNCHER and c["args"] == ["prefect", "flow-run", "execute"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and "hostNetwork" not in pod
    kimi = load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml", ["extract.gpu_memory_gib=80"])
    jv = job_variables(kimi, "extract", 25)
    assert spec["activeDeadlineSeconds"] == jv["deadline_seconds"]
    assert c["resources"]["requests"]["memory"] == jv["memory_request"]
    env = {e["name"]: e for e in c["env"]}
    assert env[nodes.MASTER_ADDR_ENV]["value"] == f"$({nodes.SET_ID_ENV})-0.{nodes.ENGINE_SERVICE}"
    assert [e["name"] for e in c["env"]].index(nodes.SET_ID_ENV) < [e["name"] for e in c["env"]].index(
        nodes.MASTER_ADDR_ENV)  # Kubernetes expands $(VAR) only from variables defined before
    rdma = split == "tp"
    assert ("rdma/ib" in c["resources"]["limits"]) == rdma == ("NCCL_IB_HCA" in env)
    assert ("IPC_LOCK" in c["securityContext"]["capabilities"].get("add", [])) == rdma


def test_the_multi_node_engine_design_is_the_rendering(monkeypatch):
    """docs/decisions/multi-node-engine.yaml is what `python -m eagle3_pipeline.pipeline.engine_sets` renders (the
    command its header names), so the design a reader checks against Kubernetes' documentation is the code's."""
    from eagle3_pipeline.pipeline.engine_sets import render

    path = ROOT / "docs" / "decisions" / "multi-node-engine.yaml"
    text = path.read_text()
    assert "eagle3_pipeline.pipeline.engine_sets" in text.split("---")[0]
    monkeypatch.chdir(ROOT)
    rendered = list(yaml.safe_load_all(render([*ENGINE_SET_ARGS, "--split", "pp"])))
    assert [d for d in yaml.safe_load_all(text) if d] == rendered
