"""The work pools as `deployed` created them: the process pool the tests run on, and the Kubernetes
GPU pool whose base job template (infra/k8s-gpu-job-template.json) the server accepted."""


def test_work_pools_and_gpu_limit(client, deployed):
    from tests.helpers.server import GPU_LIMIT, POOL

    assert client.read_work_pool(POOL).type == "process"
    gpu = client.read_work_pool("eagle3-gpu")
    assert gpu.type == "kubernetes"
    tmpl = gpu.base_job_template
    (container,) = tmpl["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert tmpl["variables"]["properties"]["gpu_count"]["default"] == 8
    assert client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 2  # two nodes here
    assert {d.name for d in client.read_deployments()} == {"pipeline", "refresh", "rerun-failed", "extract-group",
                                                           "verify-stage", "train-stage", "evaluate-stage"}
