"""Search for MuZero, written on mctx (pure JAX, no C++ tree code): podray.search.search."""

from podray.search.search import (
    POLICIES,
    VALUE_NORMALIZATIONS,
    Model,
    ModelOutput,
    SearchOutput,
    make_search,
    policy_entropy,
    qtransform_by_tree_min_max,
    temperature_at,
)

__all__ = [
    "Model",
    "ModelOutput",
    "POLICIES",
    "SearchOutput",
    "VALUE_NORMALIZATIONS",
    "make_search",
    "policy_entropy",
    "qtransform_by_tree_min_max",
    "temperature_at",
]
