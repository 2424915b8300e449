"""Style registry and the no-op base (STYLE-1, STYLE-2)."""

import pytest
import torch
from torch import nn

from raymoe import ParallelStyle, register
from raymoe.parallel.styles import STYLES, StyleRegistry, builtin_styles


class Custom(ParallelStyle):
    pass


def test_register_and_get():
    registry = StyleRegistry()
    style = Custom()
    registry.register("colwise_custom", style)
    assert registry.get("colwise_custom") is style
    assert "colwise_custom" in registry and len(registry) == 1 and list(registry) == ["colwise_custom"]


def test_register_twice_needs_replace():
    registry = StyleRegistry()
    registry.register("x", Custom())
    with pytest.raises(ValueError, match="'x' is already registered"):
        registry.register("x", Custom())
    replacement = Custom()
    registry.register("x", replacement, replace=True)
    assert registry.get("x") is replacement


def test_register_rejects_non_styles_and_bad_names():
    registry = StyleRegistry()
    with pytest.raises(TypeError, match="needs a ParallelStyle instance, got type"):
        registry.register("x", Custom)
    with pytest.raises(ValueError, match="non-empty strings"):
        registry.register(" ", Custom())


def test_unknown_name_lists_registered_styles():
    registry = StyleRegistry()
    registry.register("b_style", Custom())
    registry.register("a_style", Custom())
    with pytest.raises(ValueError, match=r"tp_plan\['x'\]: unknown style 'nope'; registered styles: a_style, b_style"):
        registry.check("nope", where="tp_plan['x']")
    assert registry.get("nope") is None  # a Mapping: get() answers None, check() explains


def test_global_register_adds_to_the_global_registry():
    register("test_only_style", Custom())
    try:
        assert isinstance(STYLES.get("test_only_style"), Custom)
    finally:
        STYLES.unregister("test_only_style")


def test_the_registry_is_seeded_with_fresh_builtin_instances():
    assert set(STYLES) == set(builtin_styles())
    assert STYLES["colwise"] is not builtin_styles()["colwise"]


def test_base_hooks_are_no_ops():
    style = ParallelStyle()
    module = nn.Linear(4, 4)
    forward = module.forward
    args, kwargs = (torch.ones(1, 4),), {"k": 1}
    mesh = None  # the base never touches the mesh
    assert style.validate_param(module, "weight", module.weight, 2) is None
    assert style.shard_param(module, "weight", module.weight, mesh) is module.weight
    assert style.transform_inputs_pre_forward(module, args, kwargs, mesh) == (args, kwargs)
    with style.context_around_forward(module, mesh) as entered:
        assert entered is None
    out = object()
    assert style.transform_output_post_forward(module, out, mesh) is out
    assert style.should_use_local_tensors(module) is False
    style.install_forward(module, mesh)
    assert module.forward == forward
    assert repr(Custom()) == "Custom()"


def test_unregister_takes_a_users_style_away_and_brings_a_replaced_builtin_back():
    import raymoe

    registry = StyleRegistry(builtin_styles())
    original = registry["colwise"]
    mine = type(original)()
    registry.register("colwise", mine, replace=True)
    assert registry.unregister("colwise") is mine and registry["colwise"] is original
    with pytest.raises(ValueError, match=r"unregister: 'colwise' is a built-in style and stays registered"):
        registry.unregister("colwise")
    with pytest.raises(ValueError, match=r"unregister: unknown style 'nope'; registered styles: "):
        registry.unregister("nope")
    raymoe.register("test_unregister_style", mine)
    assert raymoe.unregister("test_unregister_style") is mine and "test_unregister_style" not in STYLES
