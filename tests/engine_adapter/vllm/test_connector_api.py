"""`TierKVConnector` against vLLM's KV-connector base classes, without running vLLM:

- against vLLM 0.33 (CUDA wheels only, never installed here): the facts below, read from its
  `vllm/distributed/kv_transfer/kv_connector/v1/base.py`, are checked against the connector's
  source (parsed, so this runs in every environment): every abstract method implemented, the
  sleep-mode hooks 0.33 added implemented, and every method the connector overrides callable
  as 0.33 calls it;
- against the installed vLLM (0.32), where there is one: the same through `inspect`.

The vendored facts are names only (no vLLM code). To refresh them for a new vLLM:
`pip download vllm==X --no-deps -d /tmp/v && unzip -q /tmp/v/*.whl 'vllm/distributed/*' -d /tmp/v`,
then `python tests/engine_adapter/vllm/test_connector_api.py
/tmp/v/vllm/distributed/kv_transfer/kv_connector/v1/base.py` prints the table to paste here.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

from tests import ROOT

# vLLM 0.33.0, kv_connector/v1/base.py: method -> (kind, parameters after self/cls), for
# KVConnectorBase_V1's abstract methods, SupportsHMA's, the sleep-mode hooks 0.33 added, and
# the base methods TierKVConnector overrides. kind: "abstract", "method", "classmethod".
VLLM_033_BASE: dict[str, tuple[str, tuple[str, ...]]] = {
    "start_load_kv": ("abstract", ("forward_context", "**kwargs")),
    "wait_for_layer_load": ("abstract", ("layer_name",)),
    "save_kv_layer": ("abstract", ("layer_name", "kv_layer", "attn_metadata", "**kwargs")),
    "wait_for_save": ("abstract", ()),
    "get_num_new_matched_tokens": ("abstract", ("request", "num_computed_tokens")),
    "update_state_after_alloc": ("abstract", ("request", "blocks", "num_external_tokens")),
    "build_connector_meta": ("abstract", ("scheduler_output",)),
    "request_finished_all_groups": ("abstract", ("request", "block_ids")),  # SupportsHMA
    "supports_sleep_mode": ("classmethod", ("kv_transfer_config",)),
    "unregister_kv_caches": ("method", ()),
    "restore_kv_caches": ("method", ()),
    "__init__": ("method", ("vllm_config", "role", "kv_cache_config")),
    "register_kv_caches": ("method", ("kv_caches",)),
    "bind_connector_metadata": ("method", ("connector_metadata",)),
    "finish_forward": ("method", ()),
    "get_finished": ("method", ("finished_req_ids",)),
    "get_transfer_results": ("method", ("finished_req_ids",)),
    "get_block_ids_with_load_errors": ("method", ()),
    "shutdown": ("method", ()),
    "get_kv_connector_stats": ("method", ()),
    "build_connector_worker_meta": ("method", ()),
    "get_external_cache_hit_sources": ("method", ("request", "num_external_tokens")),
    "update_connector_output": ("method", ("connector_output",)),
    "request_finished": ("method", ("request", "block_ids")),
    "build_kv_connector_stats": ("classmethod", ("data",)),
    "build_prom_metrics": ("classmethod", ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
}
ADDED_IN_033 = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")
CONNECTOR = ROOT / "engine_adapter" / "vllm" / "connector.py"


def _params(args: ast.arguments) -> tuple[tuple[str, ...], int]:
    """(parameter names after self/cls, `*`/`**` marked; how many of them have defaults)."""
    names = [a.arg for a in [*args.posonlyargs, *args.args][1:]]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    defaults = len(args.defaults) + sum(d is not None for d in args.kw_defaults)
    return tuple(names), defaults


def methods_in_source(path: Path, class_names: tuple[str, ...]) -> dict[str, tuple[str, tuple[str, ...], int]]:
    """The methods the classes `class_names` of the file `path` define: name -> (kind,
    parameters, number of defaults); read from its syntax tree, nothing imported."""
    out: dict[str, tuple[str, tuple[str, ...], int]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in class_names:
            for f in node.body:
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                    decorators = {ast.unparse(d) for d in f.decorator_list}
                    if "property" in decorators:
                        continue
                    kind = ("abstract" if "abstractmethod" in decorators else
                            "classmethod" if "classmethod" in decorators else "method")
                    out[f.name] = (kind, *_params(f.args))
    return out


def incompatible(base: tuple[str, ...], ours: tuple[str, ...], defaults: int) -> str | None:
    """Why a method with parameters `ours` (`defaults` of them defaulted) cannot be called as
    the base's `base` is called (by position or by name), or None."""
    plain = [p for p in base if not p.startswith("*")]
    mine = [p for p in ours if not p.startswith("*")]
    if mine[: len(plain)] != plain:
        return f"takes {ours}, vLLM passes {base}"
    if len(mine) - len(plain) > defaults:
        return f"its extra parameters {mine[len(plain):]} need defaults"
    for star in (p for p in base if p.startswith("*")):
        kind = "**" if star.startswith("**") else "*"
        if not any(p.startswith(kind) and (kind == "**" or not p.startswith("**")) for p in ours):
            return f"takes no {star}, vLLM passes it"
    return None


def test_the_connector_implements_vllm_033s_base() -> None:
    ours = methods_in_source(CONNECTOR, ("TierKVConnector",))
    problems = []
    for name, (kind, params) in VLLM_033_BASE.items():
        if name not in ours:
            if kind == "abstract" or name in ADDED_IN_033:
                problems.append(f"{name}: not implemented")
            continue
        our_kind, our_params, defaults = ours[name]
        if our_kind == "abstract" or (our_kind == "classmethod") != (kind == "classmethod"):
            problems.append(f"{name}: a {our_kind}, vLLM 0.33 calls a {kind}")
        why = incompatible(params, our_params, defaults)
        if why:
            problems.append(f"{name}: {why}")
    assert not problems, problems


def test_the_compatibility_check_can_fail() -> None:
    """The rule above refuses what vLLM could not call."""
    assert incompatible(("request", "block_ids"), ("request", "blocks"), 0)
    assert incompatible(("forward_context", "**kwargs"), ("forward_context",), 0)
    assert incompatible(("layer_name",), ("layer_name", "extra"), 0)
    assert incompatible(("layer_name",), ("layer_name", "extra"), 1) is None
    assert incompatible(("forward_context", "**kwargs"), ("forward_context", "**kw"), 0) is None


def test_the_connector_implements_the_installed_vllms_base() -> None:
    """The same, through `inspect`, against the vLLM installed (0.32): every abstract method
    of its base and SupportsHMA implemented, every override callable as the base."""
    from tests.switches import need_vllm

    need_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    from engine_adapter.vllm.connector import TierKVConnector

    assert not getattr(TierKVConnector, "__abstractmethods__", None), TierKVConnector.__abstractmethods__
    problems = []
    for base in (KVConnectorBase_V1, SupportsHMA):
        for name, member in vars(base).items():
            if name not in vars(TierKVConnector) or isinstance(member, property) or not callable(
                    getattr(base, name)):
                continue
            want = inspect.signature(getattr(base, name))
            have = inspect.signature(getattr(TierKVConnector, name))

            def names(sig: inspect.Signature) -> tuple[str, ...]:
                mark = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
                return tuple(mark.get(p.kind, "") + p.name for p in sig.parameters.values() if p.name != "self")

            defaults = sum(p.default is not inspect.Parameter.empty for p in have.parameters.values())
            why = incompatible(names(want), names(have), defaults)
            if why:
                problems.append(f"{name}: {why}")
    assert not problems, problems


if __name__ == "__main__":  # print VLLM_033_BASE's entries from a vLLM base.py (see the docstring)
    base_methods = methods_in_source(Path(sys.argv[1]), ("KVConnectorBase_V1", "SupportsHMA"))
    ours_now = methods_in_source(CONNECTOR, ("TierKVConnector",))
    for method, (how, arguments, _) in base_methods.items():
        if how == "abstract" or method in ours_now or method in ADDED_IN_033:
            print(f"    {method!r}: ({how!r}, {arguments!r}),")
