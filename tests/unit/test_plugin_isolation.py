"""A broken third-party plugin never takes sparsekv down: each is loaded in isolation, named with its package and
entry point when skipped, and everything else runs. The plugins are fake distributions (a dist-info directory
with entry_points.txt under tmp_path, put on sys.path), which importlib.metadata finds like pip-installed ones."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

from sparsekv import PolicyConfigError, plugins
from sparsekv.llm import compose_config

REPO = Path(__file__).resolve().parents[2]
HEADER = '''
from dataclasses import dataclass
import sparsekv
from sparsekv.policies.base import SparsePolicy
'''
PLUGINS = {  # entry-point name -> (distribution, module source)
    "iso_good": ("iso-good", '''
@dataclass
class GoodPolicy(SparsePolicy):
    name: str = "iso_good_policy"
    width: int = 2

    def __post_init__(self):
        if self.width < 1:
            raise ValueError(f"width={self.width} must be at least 1")

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [GoodPolicy]
'''),
    "iso_not_dataclass": ("iso-not-dataclass", '''
class Plain(SparsePolicy):
    name = "plain"

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [Plain]
'''),
    "iso_not_policy": ("iso-not-policy", '''
@dataclass
class NotAPolicy:
    name: str = "not_a_policy"

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [NotAPolicy]
'''),
    "iso_wrong_return": ("iso-wrong-return", '''
@sparsekv.hookimpl
def sparsekv_register_policies():
    return "quest"
'''),
    "iso_nameless": ("iso-nameless", '''
@dataclass
class Nameless(SparsePolicy):
    width: int = 2

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [Nameless]
'''),
    "iso_bad_field": ("iso-bad-field", '''
class Opaque:
    pass

@dataclass
class BadField(SparsePolicy):
    name: str = "iso_bad_field"
    thing: Opaque = None

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [BadField]
'''),
    "iso_raises": ("iso-raises", '''
@sparsekv.hookimpl
def sparsekv_register_policies():
    raise RuntimeError("hook exploded")
'''),
    "iso_misspelled": ("iso-misspelled", '''
@sparsekv.hookimpl
def sparsekv_register_policy():
    return []
'''),
    "iso_shadows_builtin": ("iso-shadows-builtin", '''
@dataclass
class Quest(SparsePolicy):
    name: str = "quest"

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [Quest]
'''),
    "iso_dup_a": ("iso-dup-a", '''
@dataclass
class DupA(SparsePolicy):
    name: str = "iso_dup"

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [DupA]
'''),
    "iso_dup_b": ("iso-dup-b", '''
@dataclass
class DupB(SparsePolicy):
    name: str = "iso_dup"

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [DupB]
'''),
    "iso_bad_import": ("iso-bad-import", '''
import iso_this_module_does_not_exist  # noqa: F401
'''),
    "iso_configs_raise": ("iso-configs-raise", '''
@dataclass
class Configless(SparsePolicy):
    name: str = "iso_configless"

@sparsekv.hookimpl
def sparsekv_register_policies():
    return [Configless]

@sparsekv.hookimpl
def sparsekv_register_configs(config_store):
    config_store.store(group="model", name="iso_half_stored", node={"name": "iso_half_stored"})
    raise KeyError("config hook exploded")
'''),
}
SAME_ENTRY_POINT = {"iso-same-one": "iso_same_one", "iso-same-two": "iso_same_two"}  # dist -> module, both "iso_same"
MODULES = [ep for ep in PLUGINS] + list(SAME_ENTRY_POINT.values())


def write_dist(site: Path, dist: str, entry_points: str) -> None:
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[sparsekv]\n{entry_points}\n")


def make_site(root: Path) -> Path:
    site = root / "site"
    site.mkdir()
    for entry, (dist, body) in PLUGINS.items():
        (site / f"{entry}.py").write_text(textwrap.dedent(HEADER + body))
        write_dist(site, dist, f"{entry} = {entry}")
    for dist, module in SAME_ENTRY_POINT.items():
        (site / f"{module}.py").write_text("")
        write_dist(site, dist, f"iso_same = {module}")
    return site


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = make_site(tmp_path)
    monkeypatch.delenv(plugins.DISABLE_AUTOLOAD_ENV, raising=False)
    monkeypatch.delenv(plugins.ALLOW_LIST_ENV, raising=False)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    plugins.reset_for_tests()
    yield root
    for name in MODULES:
        sys.modules.pop(name, None)
    plugins.reset_for_tests()


def load() -> tuple[plugins.Registry, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg = plugins.registry()
    return reg, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_every_failure_is_reported_once_with_package_and_entry_point_and_the_rest_loads(site):
    reg, messages = load()
    failed = reg.failed_plugins
    expected = {
        "iso_not_dataclass": "not a dataclass",
        "iso_not_policy": "not a SparsePolicy subclass",
        "iso_wrong_return": "returned str, not a list",
        "iso_nameless": "no `name` default of its own",
        "iso_raises": "RuntimeError: hook exploded",
        "iso_bad_field": "cannot be a config schema",
        "iso_misspelled": "sparsekv_register_policy is not a sparsekv hook; valid hooks: sparsekv_register_configs, "
                          "sparsekv_register_models, sparsekv_register_policies",
        "iso_shadows_builtin": "policy 'quest' is already registered by package sparsekv (builtin)",
        "iso_dup_a": "policy 'iso_dup' is already registered by package iso-dup-b (iso_dup_b)",
        "iso_dup_b": "policy 'iso_dup' is already registered by package iso-dup-a (iso_dup_a)",
        "iso_bad_import": "ModuleNotFoundError",
        "iso_configs_raise": "sparsekv_register_configs raised KeyError",
        "iso_same": "entry point name 'iso_same' is used by iso-same-one (iso_same_one) and iso-same-two",
    }
    assert set(failed) == set(expected), failed
    for name, fragment in expected.items():
        assert fragment in failed[name], (name, failed[name])
        named = [m for m in messages if f"plugin '{name}'" in m]
        assert len(named) == 1, (name, messages)  # once, not once per channel
        assert reg.plugins[name].package.split(",")[0] in named[0]
    assert len(messages) == len(expected)
    # what still works: the good plugin, every built-in, the default config
    assert reg.plugins["iso_good"].status == "loaded" and reg.plugins["iso_good"].policies == ["iso_good_policy"]
    assert {"full", "quest", "iso_good_policy"} <= set(reg.policies)
    assert reg.policies["quest"].__module__.startswith("sparsekv.policies.quest")  # the built-in, not a plugin's
    assert not {"iso_dup", "plain", "not_a_policy", "base", "iso_configless", "iso_bad_field"} & set(reg.policies)
    assert compose_config(["policy=iso_good_policy", "policy.width=3"]).policy.width == 3
    assert compose_config([]).policy.name == "full"
    with pytest.raises(MissingConfigException):
        compose_config(["model=iso_half_stored"])  # the failed config hook's partial work is undone
    manager = plugins.get_plugin_manager()
    assert manager.get_plugin("iso_good") is not None and manager.get_plugin("iso_raises") is None


def test_allow_list_loads_only_the_named_entry_points(site, monkeypatch):
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "iso_good, iso_dup_a")
    reg, messages = load()
    assert messages == []
    assert {"iso_good_policy", "iso_dup"} <= set(reg.policies)  # no collision once iso_dup_b is left out
    assert reg.policies["iso_dup"].__name__ == "DupA"
    assert reg.plugins["iso_raises"].status == "not allowed"
    assert "iso_raises" not in sys.modules  # not even imported


def test_allow_list_naming_a_missing_plugin_lists_the_installed_ones(site, monkeypatch):
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "iso_god")
    reg, messages = load()
    assert "SPARSEKV_PLUGINS names 'iso_god'" in reg.failed_plugins["iso_god"]
    assert "iso_good" in reg.failed_plugins["iso_god"]
    assert len(messages) == 1


def test_disable_switch_wins_over_the_allow_list(site, monkeypatch):
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "iso_good")
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    reg, messages = load()
    assert messages == [] and "iso_good_policy" not in reg.policies and set(reg.plugins) == {"builtin"}


def test_builtins_are_checked_like_plugins():
    for name, cls in plugins.registry().policies.items():
        if plugins.registry().policy_owner(name).name == "builtin":
            assert plugins.check_policy_class(cls) == name


def test_a_plugin_policy_range_error_is_a_policy_config_error_naming_the_plugin(site):
    load()
    with pytest.raises(PolicyConfigError, match=r"^policy=iso_good_policy \(plugin 'iso_good', package iso-good\): "
                                                r"width=0 must be at least 1$"):
        compose_config(["policy=iso_good_policy", "policy.width=0"])


def cli(args: list[str], site: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in (plugins.DISABLE_AUTOLOAD_ENV, plugins.ALLOW_LIST_ENV,
                                                                   "HYDRA_FULL_ERROR")}
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    environ.update(env)
    return subprocess.run([sys.executable, "-m", "sparsekv", *args], cwd=tmp_path, env=environ, capture_output=True,
                          text=True, timeout=300)


def test_the_cli_runs_beside_broken_plugins_and_lists_them(site, tmp_path):
    result = cli(["device=cpu", "sampling.max_tokens=2"], site, tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("iso_raises", "iso_not_dataclass", "iso_misspelled"):
        assert result.stderr.count(f"plugin '{name}'") == 1, result.stderr
    listed = cli(["task=plugins"], site, tmp_path, **{plugins.ALLOW_LIST_ENV: "iso_good,iso_raises"})
    assert listed.returncode == 0, listed.stderr
    out = listed.stdout
    assert "iso_good: loaded (package iso-good, entry point iso_good)\n    policies: iso_good_policy" in out
    assert ("iso_raises: failed (package iso-raises, entry point iso_raises)\n"
            "    error: RuntimeError: hook exploded") in out
    assert "iso_nameless: not allowed" in out and "builtin: loaded (package sparsekv" in out


def test_the_cli_shows_a_plugin_range_error_in_one_line(site, tmp_path):
    result = cli(["policy=iso_good_policy", "policy.width=0"], site, tmp_path, **{plugins.ALLOW_LIST_ENV: "iso_good"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: policy=iso_good_policy (plugin 'iso_good', package iso-good): width=0 must be at least 1"]
