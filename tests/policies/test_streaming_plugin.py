"""The example third-party plugin plugins/sparsekv-streamingllm, pip-installed the way a user installs it, then
selected with `policy=streaming_llm` from the Python API and the CLI without any change to sparsekv."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from sparsekv import SamplingParams, plugins
from tests.conftest import make_checkpoint, random_prompt

REPO = Path(__file__).resolve().parents[2]
PLUGIN_SRC = REPO / "plugins" / "sparsekv-streamingllm"
PLUGIN_MODULE = "sparsekv_streamingllm"


def install_streaming_plugin(root: Path) -> Path:
    """pip-install the plugin (no network, no build isolation) into root/site; returns that directory. The sources
    are copied first so that the build's scratch files stay out of the checkout."""
    source, site = root / "src", root / "site"
    shutil.copytree(PLUGIN_SRC, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--target", str(site), str(source)], check=True, capture_output=True, text=True)
    return site


@contextlib.contextmanager
def plugin_site_on_path(site: Path, allow: str = "streamingllm") -> Iterator[None]:
    """Make the installed plugin discoverable (entry points are read from sys.path), and restore the plugin state
    afterwards: path, autoload switch, loaded modules, registry and the configs it stored."""
    saved_env = os.environ.get(plugins.DISABLE_AUTOLOAD_ENV)
    saved_allow = os.environ.get(plugins.ALLOW_LIST_ENV)
    os.environ[plugins.DISABLE_AUTOLOAD_ENV] = "0"
    os.environ[plugins.ALLOW_LIST_ENV] = allow  # entry points of the site: other installed plugins cannot interfere
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    plugins.reset_for_tests()
    try:
        yield
    finally:
        sys.path.remove(str(site))
        if saved_env is None:
            os.environ.pop(plugins.DISABLE_AUTOLOAD_ENV, None)
        else:
            os.environ[plugins.DISABLE_AUTOLOAD_ENV] = saved_env
        if saved_allow is None:
            os.environ.pop(plugins.ALLOW_LIST_ENV, None)
        else:
            os.environ[plugins.ALLOW_LIST_ENV] = saved_allow
        for module in [m for m in sys.modules if m == PLUGIN_MODULE or m.startswith(PLUGIN_MODULE + ".")]:
            del sys.modules[module]
        importlib.invalidate_caches()
        plugins.reset_for_tests()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install_streaming_plugin(tmp_path_factory.mktemp("streamingllm"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


def test_installed_plugin_is_selected_from_the_python_api(site, ckpt):
    from sparsekv import LLM

    with plugin_site_on_path(site):
        registered = plugins.registry().policies
        assert "streaming_llm" in registered, sorted(registered)
        llm = LLM(str(ckpt), overrides=["device=cpu", "offload=cpu", "offload.block_size=16", "policy=streaming_llm",
                                        "policy.recent_blocks=2"])
        store = llm.engine.kv_store
        assert type(store.prefill_policy).__module__ == "sparsekv_streamingllm.policy"
        assert store.prefill_policy is store.decode_policy  # one policy for both phases
        assert (store.decode_policy.sink_blocks, store.decode_policy.recent_blocks) == (1, 2)

        prompt = random_prompt(120, seed=4)  # 7 full blocks of 16 tokens
        before = store.transfer_stats["h2d_blocks"]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
        assert len(out.token_ids) == 6
        # one-chunk prefill loads nothing; each decode step loads sink + 2 recent blocks per layer
        layers = llm.engine.spec.num_hidden_layers
        assert store.transfer_stats["h2d_blocks"] - before == 5 * layers * 3
    assert "streaming_llm" not in plugins.registry().policies  # the state is restored


def test_installed_plugin_is_selected_from_the_cli(site, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env[plugins.DISABLE_AUTOLOAD_ENV] = "0"
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, "-m", "sparsekv", "device=cpu", "offload=cpu", "offload.block_size=16",
               "policy=streaming_llm"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "output:" in result.stdout

    if importlib.util.find_spec(PLUGIN_MODULE) is None:  # not installed in this environment by other means
        # without the plugin on the path the same command fails, naming the policies that are registered
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode != 0
        assert "streaming_llm" in result.stdout + result.stderr and "full" in result.stdout + result.stderr
