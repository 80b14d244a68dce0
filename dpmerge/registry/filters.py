"""MLflow search filters: the one place search values are quoted (the client and the REST
catalog both send them). No MLflow import."""

from __future__ import annotations

from collections.abc import Mapping

from dpmerge.registry.errors import RegistryError


def search_filter(name: str | None = None, tags: Mapping[str, str] | None = None) -> str:
    """The filter for the versions of ``name`` (any model if ``None``) whose ``tags`` hold these
    values, each value quoted by :func:`_literal`."""
    terms = [] if name is None else [f"name = {_literal(name)}"]
    terms += [f"tags.`{key}` = {_literal(value)}" for key, value in (tags or {}).items()]
    return " and ".join(terms)


def _literal(value: str) -> str:
    """``value`` as a filter string. MLflow's parser strips the quotes and unescapes nothing, so
    a value holding ``'`` goes in double quotes; one holding both quote characters cannot be
    written at all."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise RegistryError(f"cannot search for {value!r}: it holds both kinds of quote")
