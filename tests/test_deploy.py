"""deploy/ (compose.yaml, Dockerfile, nginx.conf, assistant.toml) cannot run here: no images can be
pulled. So that it cannot rot silently, these tests read it and check it against the app itself:
every ASSISTANT_* variable the gateway replicas get is a setting the config loader reads, and the
whole set loads through `AssistantConfig.load` with the mounted TOML; every service URL names a
service of the same file on the port it listens on; the load balancer sends to the gateway's port;
the image installs this package with extras that exist and the pinned CPU torch.

Each running piece is proven elsewhere, one by one (README, "Deploying at scale"):
tests/test_scale_out.py (two replicas on one PostgreSQL and one Redis, an OpenAI-compatible LLM server).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from assistant.config import AssistantConfig, _from_env
from tests.conftest import REPO_ROOT, require_module

yaml = require_module("yaml", "pip install pyyaml (a dependency of transformers: `make setup`)")

DEPLOY = REPO_ROOT / "deploy"
# what tests/test_scale_out.py configures its replicas with: the compose file must use the same settings
SCALE_OUT_SETTINGS = {"ASSISTANT_CONFIG", "ASSISTANT_ENGINE_REMOTE_URL", "ASSISTANT_ENGINE_REMOTE_MODEL",
                      "ASSISTANT_ENGINE_MODEL", "ASSISTANT_STORE_URL", "ASSISTANT_SERVER_REDIS_URL"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def gateway(compose) -> dict:
    return compose["services"]["gateway"]


@pytest.fixture(scope="module")
def env(gateway) -> dict[str, str]:
    environment = gateway["environment"]
    assert isinstance(environment, dict), "keep the gateway's environment a mapping (NAME: value)"
    return {name: str(value) for name, value in environment.items()}


def _mounted(service: dict, target: str) -> Path:
    """The file of deploy/ that a service mounts at `target`."""
    for volume in service.get("volumes", []):
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target and source.startswith("."):
            return (DEPLOY / source).resolve()
    raise AssertionError(f"nothing of deploy/ is mounted at {target}")


def _flat(values: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _loaded(env: dict[str, str], gateway: dict) -> AssistantConfig:
    config_file = _mounted(gateway, env["ASSISTANT_CONFIG"])
    return AssistantConfig.load(env={**env, "ASSISTANT_CONFIG": str(config_file)})


def test_every_gateway_variable_is_a_setting_the_app_reads(env, gateway):
    for name, value in env.items():
        assert name.startswith("ASSISTANT_"), f"{name}: the gateway is configured through ASSISTANT_* only"
        assert name == "ASSISTANT_CONFIG" or _from_env({name: value}), \
            f"{name} is not a setting assistant/config.py reads: it would be ignored"
    config = _loaded(env, gateway)  # the mounted TOML too: an unknown key or a bad value raises ConfigError
    for path, value in _flat(_from_env(env)).items():
        got = config
        for part in path.split("."):
            got = getattr(got, part)
        assert str(got) == value, f"{path}: compose sets {value!r}, the app reads {got!r}"
    assert set(config.server.tiers) >= {"free", "paid"} and config.server.default_tier in config.server.tiers
    assert SCALE_OUT_SETTINGS <= set(env), "compose must configure replicas as tests/test_scale_out.py does"


def test_every_service_url_names_a_service_of_this_file(compose, env, gateway):
    services = compose["services"]
    config = _loaded(env, gateway)
    assert set(services) == {"gateway", "lb", "vllm", "qdrant", "postgres", "redis"}
    assert set(gateway["depends_on"]) == {"postgres", "redis", "qdrant", "vllm"}
    assert config.server.host == "0.0.0.0"  # reachable by the balancer; refused at start-up without a key

    llm = urlsplit(config.engine.remote_url)
    vllm_args = dict(arg.removeprefix("--").partition("=")[::2] for arg in services["vllm"]["command"])
    assert (llm.hostname, llm.port) == ("vllm", int(vllm_args.get("port", 8000)))
    assert vllm_args["served-model-name"] == config.engine.remote_model
    assert int(vllm_args["max-model-len"]) == config.engine.max_context_tokens
    assert "enable-auto-tool-choice" in vllm_args and vllm_args["tool-call-parser"]  # tools -> tool_calls
    assert services["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]

    from sqlalchemy.engine import make_url

    store, pg = make_url(config.store.url), services["postgres"]["environment"]
    assert store.drivername == "postgresql+psycopg" and store.host == "postgres" and store.port in (None, 5432)
    assert (store.username, store.password, store.database) == \
        (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"])
    redis = urlsplit(config.server.redis_url)
    assert (redis.scheme, redis.hostname, redis.port or 6379) == ("redis", "redis", 6379)
    qdrant = urlsplit(config.retrieval.qdrant_url)
    assert (qdrant.hostname, qdrant.port) == ("qdrant", 6333)


def test_the_load_balancer_sends_to_the_gateway_port(compose, env, gateway):
    config = _loaded(env, gateway)
    lb = compose["services"]["lb"]
    nginx = _mounted(lb, "/etc/nginx/conf.d/default.conf").read_text()
    upstreams = re.findall(r"^\s*server\s+([\w.-]+):(\d+)\s*;", nginx, re.MULTILINE)
    assert upstreams and all((host, int(port)) == ("gateway", config.server.port) for host, port in upstreams)
    listen = re.search(r"^\s*listen\s+(\d+)\s*;", nginx, re.MULTILINE).group(1)
    assert any(str(p).endswith(f":{listen}") for p in lb["ports"])
    size = re.search(r"client_max_body_size\s+(\d+)m\s*;", nginx).group(1)
    assert int(size) << 20 >= config.server.max_upload_bytes
    assert re.search(r"upstream gateway_web\s*{\s*ip_hash;", nginx), "the web chat's sessions must stick"


def test_the_image_installs_this_package_with_cpu_torch(gateway, env):
    build = gateway["build"]
    dockerfile_path = (DEPLOY / build["context"] / build["dockerfile"]).resolve()
    assert dockerfile_path == DEPLOY / "Dockerfile"
    dockerfile = dockerfile_path.read_text()
    assert re.search(r"--index-url https://download\.pytorch\.org/whl/cpu 'torch==2\.13\.0'", dockerfile)
    assert "torch==2.13.0" in (REPO_ROOT / "requirements" / "engine.txt").read_text()  # the same pin

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["tool"]["setuptools"]["dynamic"]["optional-dependencies"])
    wanted = re.search(r"pip install '\.\[([\w,]+)\]'", dockerfile).group(1).split(",")
    assert set(wanted) <= extras, f"unknown extras: {set(wanted) - extras}"
    copied = set(re.findall(r"^COPY ([\w.-]+)/? ", dockerfile, re.MULTILINE))
    top_level = {name for name in pyproject["tool"]["setuptools"]["packages"] if "." not in name}
    assert top_level | {"pyproject.toml", "requirements"} <= copied, \
        f"packages not copied into the image: {top_level - copied}"

    from assistant.models.media import resolve_media_model

    for name in re.search(r"assistant models prepare ([\w. ]+)", dockerfile).group(1).split():
        resolve_media_model(name)  # a packaged speech/vision model, or it raises
    assert f"ASSISTANT_MODELS_DIR={env['ASSISTANT_MODELS_DIR']}" in dockerfile
    assert re.search(rf'CMD \["assistant", "serve", .*"--port", "{env["ASSISTANT_SERVER_PORT"]}"\]', dockerfile)
