"""Router settings for tests written by field name: ``router_config(min_cluster_size=3, explore_rate=0.0)``
puts each field in the section of :class:`config.RouterConfig` that declares it, so that a test
names what it sets without spelling out the nesting (a name no section declares is an error)."""

from __future__ import annotations

from config import RouterConfig


def router_config(**settings) -> RouterConfig:
    top, sections = {}, {}
    owner = {f: s for s, info in RouterConfig.model_fields.items() if hasattr(info.annotation, "model_fields")
             for f in info.annotation.model_fields}
    for name, value in settings.items():
        if name in RouterConfig.model_fields:
            top[name] = value
        elif name in owner:
            sections.setdefault(owner[name], {})[name] = value
        else:
            raise TypeError(f"no section of RouterConfig declares {name!r}")
    return RouterConfig(**top, **sections)
