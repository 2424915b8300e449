"""Router replay (RL): the experts a forward chose, kept per sparse layer, and fed back to later forwards.

A policy-gradient step compares the policy that sampled a rollout with the one being trained; with MoE the
two must route every token through the same experts, or the ratio is taken between different networks.
Routes travel as ``[B, S, L_moe, K]`` global expert ids (``int16`` on the wire), slot ``j`` of ``L_moe`` for
the model's ``j``-th sparse layer (``ModelConfig.sparse_slots``)::

    keep_routes(model, True)      every router keeps the ids of its next forwards (training or not)
    model(ids)                    router of layer i: ids [T, K] -> kept_routes_TK
    take_routes(model)            {slot: [T, K]} of the routers this model (or part) holds; cleared
    model(ids, routes_BSLK=R)     each sparse layer's router uses R[:, :, slot] instead of its top-k

The gate weights of a replayed forward are the current router's probabilities at the replayed ids,
normalised and scaled as the family does (:class:`~raymoe.models.moe.router.TopKRouter`), so the router's
gradient is the one a forward that chose those experts gets; no capacity limit drops a replayed pair.
"""

from __future__ import annotations

from torch import Tensor, nn

from raymoe.models.moe.router import TopKRouter


def routers_by_layer(model: nn.Module) -> dict[int, TopKRouter]:
    """The routers ``model`` holds, by decoder layer index (read from the module path ``...layers.{i}...``)."""
    found: dict[int, TopKRouter] = {}
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            parts = name.split(".")
            found[int(parts[parts.index("layers") + 1])] = module
    return found


def keep_routes(model: nn.Module, on: bool) -> None:
    """Make every router of ``model`` keep (or stop keeping) the ids of its forwards; drops what was kept."""
    for router in routers_by_layer(model).values():
        router.keep_routes = on
        router.kept_routes_TK = None


def take_routes(model: nn.Module, slots: dict[int, int]) -> dict[int, Tensor]:
    """``{slot: ids [T, K]}`` of the last forward of each router that kept routes (``slots``: layer -> slot);
    each router's kept ids are cleared."""
    taken: dict[int, Tensor] = {}
    for layer, router in routers_by_layer(model).items():
        if router.kept_routes_TK is not None:
            taken[slots[layer]] = router.kept_routes_TK
            router.kept_routes_TK = None
    return taken
