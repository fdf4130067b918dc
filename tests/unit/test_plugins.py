"""Plugins are found through the `sparsekv` entry-point group, the same way a pip-installed third-party
package would be: a real package is built and installed into a temporary site directory."""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

import sparsekv
from sparsekv import hookspecs, plugins
from sparsekv.llm import compose_config

DEMO_PLUGIN = '''
from dataclasses import dataclass

import sparsekv
from sparsekv.policies.base import SparsePolicy


@dataclass
class DemoPolicy(SparsePolicy):
    """Keeps the last `window_blocks` blocks."""
    name: str = "demo_window"
    window_blocks: int = 2
    supports_prefill = False


@sparsekv.hookimpl
def sparsekv_register_policies():
    return [DemoPolicy]


@sparsekv.hookimpl
def sparsekv_register_configs(config_store):
    config_store.store(group="model", name="demo_model", node={"name": "demo_model", "load_format": "dummy",
                                                               "hidden_size": 32})
'''

BROKEN_PLUGIN = '''
import sparsekv_this_module_does_not_exist  # noqa: F401 - the import error is the point
'''


def write_package(root: Path, dist: str, module: str, entry_name: str, source: str) -> Path:
    pkg = root / dist
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text("")
    (pkg / module / "plugin.py").write_text(textwrap.dedent(source))
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.0.1"

        [project.entry-points.sparsekv]
        {entry_name} = "{module}.plugin"

        [tool.setuptools]
        packages = ["{module}"]
    '''))
    return pkg


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """Both packages installed (no network, no build isolation) into one target directory."""
    root = tmp_path_factory.mktemp("plugins")
    demo = write_package(root, "demo-sparsekv-plugin", "demo_sparsekv_plugin", "demo", DEMO_PLUGIN)
    broken = write_package(root, "broken-sparsekv-plugin", "broken_sparsekv_plugin", "broken", BROKEN_PLUGIN)
    site = root / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                             "--no-index", "--disable-pip-version-check", "--quiet", "--target", str(site),
                             str(demo), str(broken)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(site.glob("demo_sparsekv_plugin-*.dist-info")), list(site.iterdir())
    return site


@pytest.fixture
def fresh_plugins():
    """Every test starts and ends with a manager that has not loaded the temporary site's plugins."""
    plugins.reset_for_tests()
    saved_path = list(sys.path)
    yield
    sys.path[:] = saved_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("demo_sparsekv_plugin", "broken_sparsekv_plugin")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    plugins.reset_for_tests()


@pytest.fixture
def installed(plugin_site, fresh_plugins, monkeypatch):
    monkeypatch.delenv(plugins.DISABLE_AUTOLOAD_ENV, raising=False)
    sys.path.insert(0, str(plugin_site))
    importlib.invalidate_caches()
    plugins.reset_for_tests()
    return plugin_site


def load_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return plugins.registry()


def test_entry_point_policy_is_registered_and_composes(installed):
    reg = load_quietly()
    assert "demo_window" in reg.policies
    assert "full" in reg.policies  # built-ins still there
    cfg = compose_config(["policy=demo_window", "policy.window_blocks=7"])
    assert cfg.policy.name == "demo_window"
    assert cfg.policy.window_blocks == 7
    policy = OmegaConf.to_object(cfg.policy)
    assert type(policy) is reg.policies["demo_window"]
    assert policy.window_blocks == 7 and policy.supports_prefill is False
    with pytest.raises(ValueError, match="policy.window_blocks"):  # typed like any built-in schema
        compose_config(["policy=demo_window", "policy.window_blocks=wide"])


def test_plugin_registered_configs_compose(installed):
    load_quietly()
    cfg = compose_config(["model=demo_model"])
    assert cfg.model.name == "demo_model" and cfg.model.hidden_size == 32
    assert cfg.model.num_hidden_layers == 2  # the rest from the ModelConfig schema


def test_the_plugin_is_registered_under_its_entry_point_name(installed):
    load_quietly()
    manager = plugins.get_plugin_manager()
    module = manager.get_plugin("demo")
    assert module is not None and module.__name__ == "demo_sparsekv_plugin.plugin"
    assert manager.get_plugin("broken") is None


def test_a_plugin_that_fails_to_import_is_named_and_skipped(installed):
    with pytest.warns(RuntimeWarning) as record:
        reg = plugins.registry()
    messages = [str(w.message) for w in record]
    broken = [m for m in messages if "'broken'" in m]
    assert broken, messages
    assert "broken_sparsekv_plugin.plugin" in broken[0]
    assert "broken-sparsekv-plugin" in broken[0]  # the distribution to uninstall or fix
    assert "sparsekv_this_module_does_not_exist" in broken[0]
    assert "ModuleNotFoundError" in reg.failed_plugins["broken"]
    assert "demo" not in reg.failed_plugins
    assert "demo_window" in reg.policies  # the others still load


def test_plugins_load_once_per_process(installed):
    load_quietly()
    first = plugins.get_plugin_manager()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a second discovery would warn about 'broken' again
        assert plugins.get_plugin_manager() is first
        compose_config(["policy=demo_window"])
        assert plugins.get_plugin_manager() is first


def test_disable_autoload_env_hides_entry_point_plugins(installed, monkeypatch):
    assert "demo_window" in load_quietly().policies
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    plugins.reset_for_tests()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the broken plugin is not even imported
        reg = plugins.registry()
    assert "demo_window" not in reg.policies
    assert "full" in reg.policies
    assert reg.failed_plugins == {}
    # its config is gone too: selecting it is an error that lists what is registered
    with pytest.raises(MissingConfigException, match="full"):
        compose_config(["policy=demo_window"])


def test_state_is_clean_without_the_site(fresh_plugins):
    """After the other tests' teardown, nothing of the demo plugin remains (other test files are unaffected)."""
    assert "demo_window" not in plugins.registry().policies
    with pytest.raises(MissingConfigException):
        compose_config(["policy=demo_window"])
    assert compose_config([]).policy.name == "full"


def test_builtins_go_through_the_same_manager():
    manager = plugins.get_plugin_manager()
    builtin = manager.get_plugin("builtin")
    assert builtin is not None and builtin.__name__ == "sparsekv.builtin_plugin"
    models = {}
    for result in manager.hook.sparsekv_register_models():
        models.update(result)
    from sparsekv.models.llama import LlamaForCausalLM
    from sparsekv.models.qwen3 import Qwen3ForCausalLM

    assert models["Qwen3ForCausalLM"] is Qwen3ForCausalLM
    assert models["LlamaForCausalLM"] is LlamaForCausalLM
    reg = plugins.registry()
    assert reg.models["Qwen3ForCausalLM"] is Qwen3ForCausalLM
    assert reg.models["LlamaForCausalLM"] is LlamaForCausalLM
    from sparsekv.policies.full import FullAttentionPolicy

    assert reg.policies["full"] is FullAttentionPolicy
    # the builtin module's implementations are the ones the hooks call
    impls = {impl.plugin_name for impl in manager.hook.sparsekv_register_policies.get_hookimpls()}
    assert "builtin" in impls


def test_every_hook_is_documented():
    specs = [name for name, obj in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("sparsekv_")]
    assert {"sparsekv_register_models", "sparsekv_register_policies", "sparsekv_register_configs"} <= set(specs)
    manager = plugins.get_plugin_manager()
    for name in specs:
        doc = inspect.getdoc(getattr(hookspecs, name))
        assert doc and len(doc) > 40, f"hook {name} has no docstring"
        assert hasattr(manager.hook, name), f"{name} is not a registered hookspec"
    module_doc = inspect.getdoc(hookspecs)
    assert "[project.entry-points.sparsekv]" in module_doc
    assert sparsekv.hookimpl is hookspecs.hookimpl


def test_policy_without_a_name_default_is_rejected():
    from dataclasses import dataclass

    @dataclass
    class Nameless:
        window: int = 1

    with pytest.raises(TypeError, match="name"):
        plugins.policy_name(Nameless)
