"""``tuneport serve --dry-run --on ray``: the Serve config it writes is accepted by Ray's own schema
(``ServeDeploySchema``) and builds the application, the KubeRay ``RayService`` manifest by KubeRay's published CRD
schema (v1.7.0, tests/real/kuberay; unknown fields refused, as ``kubectl apply --validate=strict`` does); bad
options exit 2 before anything starts. No cluster is started here (tests/test_serve_ray.py runs one)."""

from __future__ import annotations

import functools
import gzip
import json
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")
CRD = Path(__file__).parent / "real" / "kuberay" / "ray.io_rayservices.v1.7.0.yaml.gz"


def strict(schema: dict) -> dict:
    """The CRD's OpenAPI schema with unknown fields refused where Kubernetes would prune them silently."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


@functools.cache
def rayservice_schema() -> dict:
    crd = yaml.safe_load(gzip.decompress(CRD.read_bytes()))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])


def dry_run(cli, zoo, tmp_path, *extra) -> tuple[dict, dict, dict]:
    out = tmp_path / "deploy"
    code, stdout, err = cli("serve", "--base", zoo.base("llama"), "--engine", "llamacpp", "--on", "ray",
                            "--adapter-dir", str(tmp_path), "--max-adapters", "4", "--dry-run", "--json",
                            "--deploy-dir", str(out), *extra)
    assert code == 0, err
    report = json.loads(stdout)
    config = yaml.safe_load((out / "serve_config.yaml").read_text())
    manifest = yaml.safe_load((out / "rayservice.yaml").read_text())
    return report, config, manifest


@pytest.mark.parametrize("extra", [("--replicas", "3"),
                                   ("--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "3",
                                    "--gpus-per-replica", "1", "--cpus-per-replica", "2")],
                         ids=["fixed", "autoscaling-gpu"])
def test_dry_run_files_pass_rays_schema_and_kuberays_crd(cli, zoo, tmp_path, extra):
    import jsonschema
    from ray.serve.schema import ServeDeploySchema

    from tuneport.serve.rayserve.app import build

    report, config, manifest = dry_run(cli, zoo, tmp_path, *extra)
    ServeDeploySchema.model_validate(config)  # raises on anything Ray's `serve deploy` would refuse
    app = config["applications"][0]
    assert app["import_path"] == "tuneport.serve.rayserve.app:build" and app["route_prefix"] == "/"
    replica = next(d for d in app["deployments"] if d["name"] == "AdapterReplica")
    if "--min-replicas" in extra:
        assert replica["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in replica
        assert replica["autoscaling_config"]["target_ongoing_requests"] == 3
        assert replica["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0}
    else:
        assert replica["num_replicas"] == 3 and replica["ray_actor_options"]["num_gpus"] == 0
    assert app["args"]["options"]["engine"] == "llamacpp" and app["args"]["options"]["max_adapters"] == 4
    built = build(app["args"])  # the builder Ray imports turns the same args into the application
    assert type(built).__name__ == "Application"

    jsonschema.validate(manifest, rayservice_schema())
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"] == config["applications"]
    assert [c["argv"][:2] for c in report["commands"]] == [["ray", "get-auth-token"], ["ray", "start"],
                                                             ["serve", "deploy"], ["kubectl", "apply"]]
    assert report["commands"][1]["env"]["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"].startswith("tuneport.")


def test_the_crd_check_refuses_what_kuberay_would(cli, zoo, tmp_path):
    """The schema check has teeth: a misspelt field and a wrong type fail it."""
    import jsonschema

    _, _, manifest = dry_run(cli, zoo, tmp_path)
    schema = rayservice_schema()
    bad = json.loads(json.dumps(manifest))
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.validate(bad, schema)
    bad = json.loads(json.dumps(manifest))
    bad["spec"]["serveConfigV2"] = {"applications": []}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize("args,message", [
    (["--engine", "nosuch"], "nosuch"),
    (["--gpus-per-replica", "4"], "GPUs, but this machine has"),
    (["--cpus-per-replica", "64"], "CPUs, but this machine has"),
    (["--adapter-dir", "/nonexistent/adapters"], "--adapter-dir /nonexistent/adapters is not a directory"),
    (["--min-replicas", "2"], "--min-replicas and --max-replicas go together"),
    (["--min-replicas", "3", "--max-replicas", "2"], "need 1 <= min <= max"),
], ids=["unknown-engine", "more-gpus", "more-cpus", "missing-adapter-dir", "half-autoscaling", "min-over-max"])
def test_bad_options_exit_2_before_ray_starts(cli, zoo, args, message):
    import ray

    code, out, err = cli("serve", "--base", zoo.base("llama"), "--on", "ray", "--port", "0", *args)
    assert code == 2 and message in err, (code, err)
    assert "Traceback" not in err and not ray.is_initialized()


def test_ray_options_without_on_ray_and_ray_missing(cli, zoo, monkeypatch):
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--min-replicas", "1", "--max-replicas", "2")
    assert code == 2 and "--min-replicas applies to --on ray" in err
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--on", "ray", "--port", "0")
    assert code == 2 and "pip install 'tuneport[ray]'" in err, err
