"""sparsekv.testing, the policy conformance kit: every built-in policy and the bundled streaming plugin pass it, a
minimal scorer plugin installed through an entry point (docs/plugins.md's worked example) passes it, and each
check fails on a policy that breaks its rule. The validator names the policy, the layer and the bad value."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from sparsekv import plugins
from sparsekv.builtin_plugin import POLICY_CLASSES, load
from sparsekv.policies import PolicyContext, PolicySelectionError, SparsePolicy, check_selection
from sparsekv.policies.context import PagedChoice
from sparsekv.policies.quest import QuestPolicy
from sparsekv.testing import (CHECKS, check_full_budget, check_graph_safe, check_metadata_bytes, check_paged_selection,
                              check_policy, check_valid_selections, run_check)
from tests.policies.test_streaming_plugin import install_streaming_plugin, plugin_site_on_path

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")

# (fields that make the policy select on the tiny model, fields whose budget covers everything)
KIT_FIELDS: dict[str, tuple[dict, dict | None]] = {
    "full": ({}, None),
    "quest": ({"token_budget": 32, "dense_layers": 0}, {"token_budget": 1 << 30}),
    "minference": ({"vertical_size": 8, "slash_size": 16, "last_q": 8, "sink_tokens": 2, "recent_diagonals": 4},
                   {"vertical_size": 10 ** 6, "slash_size": 10 ** 6}),
    "xattn_bsa": ({"threshold": 0.5, "stride": 4, "block_size": 16}, {"threshold": 1.0}),
    "streaming_llm": ({"sink_blocks": 1, "recent_blocks": 2, "block_size": 16}, {"recent_blocks": 10 ** 6}),
    "mean_key": ({"token_budget": 32}, None),
}
BUILTIN = [plugins.policy_name(load(path)) for path in POLICY_CLASSES]


def write_example_plugin(site: Path) -> None:
    """docs/plugins.md's worked example as a third-party package: a module plus a dist-info with its entry point."""
    text = (REPO / "docs" / "plugins.md").read_text()
    code = re.search(r"<!-- example: plugin module -->\n```python\n(.*?)```", text, re.S).group(1)
    package = site / "mean_key_plugin"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(code)
    info = site / "mean_key_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mean-key-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sparsekv]\nmean_key = mean_key_plugin\n")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Built-ins, the bundled streaming plugin (pip-installed) and the example scorer (dist-info on the path)."""
    site = install_streaming_plugin(tmp_path_factory.mktemp("streamingllm"))
    write_example_plugin(site)
    with plugin_site_on_path(site, allow="streamingllm,mean_key"):
        yield plugins.registry()


def test_every_builtin_policy_is_in_the_matrix():
    assert set(BUILTIN) <= set(KIT_FIELDS), sorted(set(BUILTIN) - set(KIT_FIELDS))


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", sorted(KIT_FIELDS))
def test_policy_passes_the_kit(name, check, registry):
    """Every policy this module knows, through the same checks a plugin author runs; other installed plugins are
    their authors' to test."""
    assert name in registry.policies, f"{name} is not registered: {sorted(registry.policies)}"
    fields, covering = KIT_FIELDS[name]
    run_check(check, registry.policies[name], covering=covering, **fields)


def test_check_policy_runs_every_check(registry):
    check_policy(registry.policies["mean_key"], token_budget=32)
    with pytest.raises(ValueError, match="not a conformance check; choose from full_budget"):
        run_check("fast", registry.policies["full"])


# ---------------------------------------------------------------------------------------------- broken policies
@dataclass
class PastTheEnd(SparsePolicy):
    name: str = "past_the_end"
    bad: object = 10 ** 9
    requires_block_selection: ClassVar[bool] = True

    def select_blocks(self, ctx: PolicyContext):
        return [ctx.candidates[0], self.bad] if self.bad != "empty" else []


@dataclass
class KeepsOne(SparsePolicy):
    """Ignores its budget: drops every block but the newest."""
    name: str = "keeps_one"
    requires_block_selection: ClassVar[bool] = True

    def select_blocks(self, ctx: PolicyContext):
        return list(ctx.candidates[-1:])


@dataclass
class ReadsKvLen(SparsePolicy):
    """Declares decode_graph_safe (the default) yet selects by a host per-token value."""
    name: str = "reads_kv_len"
    requires_block_selection: ClassVar[bool] = True

    def select_blocks(self, ctx: PolicyContext):
        return list(ctx.candidates[: 1 + ctx.kv_len % 3])


@pytest.mark.parametrize("bad, message", [
    (10 ** 9, "layer 0, prefill, .*block id 1000000000 is not a candidate"),
    (-1, "block id -1 is not a candidate"),
    (1.0, "block id 1.0 is not an int"),
    ("empty", "empty selection"),
])
def test_valid_selections_fails_on_a_bad_selection(bad, message):
    with pytest.raises(PolicySelectionError, match=f"PastTheEnd.select_blocks \\(.*{message}"):
        check_valid_selections(PastTheEnd, bad=bad)


def test_full_budget_fails_when_blocks_are_dropped():
    with pytest.raises(AssertionError, match="KeepsOne .* max abs difference"):
        check_full_budget(KeepsOne)


def test_graph_safe_fails_on_host_state():
    with pytest.raises(AssertionError, match="ReadsKvLen declares decode_graph_safe"):
        check_graph_safe(ReadsKvLen)


@dataclass
class PagedKeepsAll(QuestPolicy):
    """Declares paged_device_selection, but its batched choice keeps every block where select_blocks drops some."""
    name: str = "paged_keeps_all"

    def select_blocks_paged(self, ctx):
        return PagedChoice(ctx.candidates.long(), ctx.num_candidates)


def test_paged_selection_fails_when_the_batched_choice_differs():
    check_paged_selection(QuestPolicy, token_budget=32, dense_layers=0)
    with pytest.raises(AssertionError, match="PagedKeepsAll declares paged_device_selection but select_blocks_paged "
                                             r"chose .* for row 0 \(layer 0, 11 candidates\)"):
        check_paged_selection(PagedKeepsAll, token_budget=32, dense_layers=0)


# ---------------------------------------------------------------------------------------------- the validator
def _ctx(candidates=(7, 3, 9, 12), layer=5) -> PolicyContext:
    return PolicyContext(phase="decode", layer=layer, query=torch.zeros(1, 4, 8), candidates=list(candidates),
                         block_size=16, query_start=100, kv_len=101, softmax_scale=0.125)


@pytest.mark.parametrize("selection, message", [
    ([7, 7], "block id 7 is selected twice"),
    ([3, 99], "block id 99 is not a candidate"),
    ([True], "block id True is not an int"),
    ([], "empty selection"),
    ("7", "returned str"),
    (torch.tensor([7.0]), "1-D int64 tensor"),
    (torch.tensor([[7]]), "1-D int64 tensor"),
    (torch.tensor([7, 3, 9, 12, 7]), "selected 5 blocks of 4 candidates"),
    (torch.tensor([], dtype=torch.int64), "empty selection"),
])
def test_validator_names_policy_layer_and_value(selection, message):
    with pytest.raises(PolicySelectionError, match=f"^KeepsOne.select_blocks \\(layer 5, decode, 4 candidates\\): "
                                                   f".*{re.escape(message)}"):
        check_selection(KeepsOne(), _ctx(), selection)


def test_validator_accepts_good_selections_in_any_order():
    assert check_selection(KeepsOne(), _ctx(), None) is None
    assert check_selection(KeepsOne(), _ctx(), (12, 7)) == [12, 7]
    ids = torch.tensor([9, 3])
    assert check_selection(KeepsOne(), _ctx(), ids) is ids


def test_device_selection_values_are_checked_only_in_debug_mode():
    bad = torch.tensor([3, 3])
    assert check_selection(KeepsOne(), _ctx(), bad) is bad  # no host sync by default
    with pytest.raises(PolicySelectionError, match="block id 3 is selected twice"):
        check_selection(KeepsOne(), _ctx(), bad, check_device=True)
    with pytest.raises(PolicySelectionError, match="block id 10 is not a candidate"):
        check_selection(KeepsOne(), _ctx(), torch.tensor([10]), check_device=True)


def test_empty_selection_allowed_when_declared():
    class MayBeEmpty(KeepsOne):
        allow_empty_selection: ClassVar[bool] = True

    assert check_selection(MayBeEmpty(), _ctx(), []) == []


@dataclass
class UndeclaredTables(QuestPolicy):
    """Keeps Quest's per-block key bounds on the device but declares none, or declares a bad value."""
    name: str = "undeclared_tables"
    declared: object = 0

    def device_bytes_per_block(self, layout):
        return self.declared


@pytest.mark.parametrize("declared, message", [
    (0, r"UndeclaredTables holds 512 more bytes of tensors per recorded host block than device_bytes_per_block "
        r"declares \(0\)"),
    (1.5, r"UndeclaredTables.device_bytes_per_block returned 1.5; expected an int >= 0"),
    (-1, r"returned -1; expected an int >= 0"),
])
def test_metadata_bytes_fails_on_undeclared_tables(declared, message):
    with pytest.raises(AssertionError, match=message):
        check_metadata_bytes(UndeclaredTables, declared=declared)
